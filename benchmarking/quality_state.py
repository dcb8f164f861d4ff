"""A time-to-quality comparison on disk, so that a stopped one continues: `bench_model.py ... --out DIR --resume`.

DIR/resume/ holds, while the comparison runs:
- `plan.json`: what is compared (the budget, or each recipe's, the interval, the validation batches, the seed, the
  data, every recipe's resolved configuration, --stop-at-target and --target-bpb); --resume continues the same plan,
  but for the budget and configuration of recipes that have not trained yet, which it may change;
- `data.json`: what the data is (training/data/record.py: its content's fingerprint); --resume refuses other data
  under the same path;
- `<size>-<recipe>.json`: a recipe that ended (its evaluations, counts and status), which --resume keeps;
- `<size>-<recipe>/`: a recipe still training, as of its last evaluation: a checkpoint (training/checkpoint: model,
  optimizer, scaler) that also holds the recipe's steps, clock and evaluations. It is written at every evaluation,
  off the clock, so that a stop of any kind (Ctrl-C, SIGTERM, a killed process or machine) loses at most one
  interval of training; --resume loads it, compiles and captures again (those steps off the clock too, as at the
  start) and goes on from that clock.
A comparison that ends with every recipe measured deletes the directory; its results are in DIR.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from training.checkpoint.files import CheckpointError
from training.checkpoint.resume import load_checkpoint, save_checkpoint
from training.config import Config, ConfigError
from training.data import DataSource
from training.data.record import DATA_NOTE, data_note, note_of, same_data
from training.parallel.distributed import DistContext
from training.run.files import write_atomic

if TYPE_CHECKING:
    from benchmarking.quality import Outcome, QualitySettings, RecipeRun

STATE_DIR = "resume"
PLAN = "plan.json"
# The plan's settings and the flags that set them, for the message when --resume is given other ones.
PLAN_FLAGS = {"budget_s": "--minutes", "interval_s": "--eval-interval-s", "eval_batches": "--eval-batches",
              "val_rows": "--batch-size (the validation batches' rows)", "seed": "--seed", "data": "--data",
              "recipes": "--recipes and --sizes", "stop_at_target": "--stop-at-target",
              "target_bpb": "--target-bpb"}
# What a plan written before a setting existed ran with.
PLAN_DEFAULTS = {"stop_at_target": False, "target_bpb": None}
COUNTS = ("steps", "timed_steps", "train_s", "warmup_s", "points")  # a RecipeRun's figures that a resume continues


def state_dir(out: Path) -> Path:
    return out / STATE_DIR


def interrupted_in(out: Path) -> bool:
    """Whether `out` holds a comparison that stopped before its end."""
    return (state_dir(out) / PLAN).is_file()


def recipe_key(size: str, label: str) -> str:
    return f"{size}-{label}"


def plan_of(settings: QualitySettings, planned: dict[tuple[str, str], tuple[Config, frozenset]],
            val_rows: int) -> dict[str, Any]:
    from benchmarking.quality import recipe_label

    recipes, budgets = {}, {}
    for (size, spec), (config, _) in planned.items():
        key = recipe_key(size, recipe_label(spec))  # one per recipe: QualitySettings has each label once
        recipes[key] = config.to_dict()
        budgets[key] = settings.budget_s(spec)
    common = settings.common_budget_s
    plan = {"budget_s": common if common is not None else budgets, "interval_s": settings.interval_s,
            "eval_batches": settings.eval_batches, "val_rows": val_rows, "seed": settings.seed, "data": settings.data,
            "recipes": recipes, "stop_at_target": settings.stop_at_target, "target_bpb": settings.target_bpb}
    return json.loads(json.dumps(plan))  # as plan.json reads back (tuples as lists), so that the two compare


def begin(settings: QualitySettings, planned: dict[tuple[str, str], tuple[Config, frozenset]], val_rows: int,
          source: DataSource) -> None:
    """Before anything trains: write the plan and what the data is, or (--resume) check that both are the stopped
    comparison's: the data by its content (training/data/record.py), not only its path."""
    directory = state_dir(settings.out)
    plan = plan_of(settings, planned, val_rows)
    if not settings.resume:
        directory.mkdir(parents=True, exist_ok=True)
        _write_json(directory / DATA_NOTE, note_of(source))
        _write_json(directory / PLAN, plan)  # last: a plan.json is what makes the directory a stopped comparison
        return
    _check_plan(settings, plan)
    recorded = data_note(directory)  # None: a state written before the data was recorded
    if recorded is not None and not same_data(recorded, source):
        data = settings.data or "the built-in corpus"
        raise ConfigError(f"--resume: --data {data} ({source.description}) is not the data the stopped comparison in "
                          f"{settings.out} trained on (recorded in {directory / DATA_NOTE}); give that data, or start a "
                          "new comparison in another --out")
    _write_json(directory / PLAN, plan)  # the recipes not yet trained as planned now


def _check_plan(settings: QualitySettings, plan: dict[str, Any]) -> None:
    """The shared settings and the recipes, in order, must be the stopped comparison's; so must the configuration and
    budget of each recipe that has trained (an outcome or a snapshot kept). One that has not may have others."""
    directory = state_dir(settings.out)
    try:
        saved = {**PLAN_DEFAULTS, **json.loads((directory / PLAN).read_text())}
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--resume: {directory / PLAN} cannot be read ({e})") from None
    then_recipes, now_recipes = saved.get("recipes") or {}, plan["recipes"]
    if list(then_recipes) != list(now_recipes):
        _refuse(settings, PLAN_FLAGS["recipes"], f"{', '.join(then_recipes)} then, {', '.join(now_recipes)} now")
    for name, flag in PLAN_FLAGS.items():
        if name not in ("budget_s", "recipes") and saved.get(name) != plan[name]:
            _refuse(settings, flag, f"{saved.get(name)!r} then, {plan[name]!r} now")
    then_budgets, now_budgets = _budgets_by_key(saved, directory / PLAN), _budgets_by_key(plan, directory / PLAN)
    for key in now_recipes:
        if not _has_trained(directory, key):
            continue
        if then_recipes[key] != now_recipes[key]:
            _refuse(settings, PLAN_FLAGS["recipes"], _recipe_difference(key, then_recipes[key], now_recipes[key]))
        if then_budgets[key] != now_budgets[key]:
            _refuse(settings, PLAN_FLAGS["budget_s"],
                    f"{key}'s {then_budgets[key] / 60:g} min then, {now_budgets[key] / 60:g} now")


def _refuse(settings: QualitySettings, flag: str, what: str) -> None:
    raise ConfigError(f"--resume: the stopped comparison in {settings.out} had other {flag} ({what}); give the flags "
                      "it had, or start a new comparison in another --out")


def _has_trained(directory: Path, key: str) -> bool:
    """Whether the recipe `key` has trained: its outcome or a snapshot is kept (it stopped after an evaluation)."""
    return (directory / f"{key}.json").is_file() or (directory / key).is_dir()


def _budgets_by_key(plan: dict[str, Any], path: Path) -> dict[str, float]:
    """Each recipe's seconds of training, by recipe key, from a plan's budget: one for all, or one for each."""
    budget = plan.get("budget_s")
    out = {}
    for key in plan.get("recipes") or {}:
        b = budget.get(key) if isinstance(budget, dict) else budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ConfigError(f"--resume: {path} cannot be read (no budget for {key})")
        out[key] = float(b)
    return out


def _recipe_difference(key: str, then: dict[str, Any], now: dict[str, Any]) -> str:
    """The first field of the recipe's configuration that differs, as 'key's section name: A then, B now'."""
    for section in dict.fromkeys([*then, *now]):
        a, b = then.get(section) or {}, now.get(section) or {}
        for name in dict.fromkeys([*a, *b]):
            if name not in a or name not in b or a[name] != b[name]:
                said = [repr(side[name]) if name in side else "absent" for side in (a, b)]
                return f"{key}'s {section} {name}: {said[0]} then, {said[1]} now"
    return f"{key}'s configuration"


def end(settings: QualitySettings) -> None:
    """Every recipe measured: the state goes (the results are in --out)."""
    shutil.rmtree(state_dir(settings.out), ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class RecipeState:
    """One recipe's place in the state directory."""

    directory: Path  # the snapshot of a recipe still training; `<directory>.json` the outcome of one that ended

    @classmethod
    def of(cls, settings: QualitySettings, size: str, label: str) -> "RecipeState":
        return cls(state_dir(settings.out) / recipe_key(size, label))

    @property
    def outcome_file(self) -> Path:
        return self.directory.with_name(self.directory.name + ".json")

    def ended(self, config: Config) -> Optional[Outcome]:
        """The outcome kept for this recipe, with its configuration as planned now, or None."""
        from benchmarking.quality import Outcome

        if not self.outcome_file.is_file():
            return None
        saved = json.loads(self.outcome_file.read_text())
        return Outcome(**{**saved, "config": config})

    def save_outcome(self, outcome: Outcome) -> None:
        """The recipe ended: its outcome is kept, its snapshot goes."""
        fields = {f.name: getattr(outcome, f.name) for f in dataclasses.fields(outcome) if f.name != "config"}
        _write_json(self.outcome_file, fields)
        shutil.rmtree(self.directory, ignore_errors=True)

    def snapshot(self, run: RecipeRun) -> None:
        """The recipe's model, optimizer and figures as of now (an evaluation, the clock stopped)."""
        step = run.step
        extra = {name: getattr(run, name) for name in COUNTS}
        save_checkpoint(self.directory, step.model, step.optimizer, step.scaler, run.steps, run.config, keep=1,
                        extra=extra)

    def restore(self, run: RecipeRun) -> bool:
        """Load the snapshot into a freshly built `run`; False when there is none."""
        if not self.directory.is_dir():
            return False
        step = run.step
        try:
            resumed = load_checkpoint(self.directory, step.model, step.optimizer, step.scaler, run.config,
                                      DistContext(device=torch.device(run.config.execution.device)), _stderr)
        except (CheckpointError, ValueError) as e:
            raise ConfigError(f"--resume: the snapshot of {run.size} {run.label} does not load ({e})") from None
        for name in COUNTS:
            setattr(run, name, resumed.extra[name])
        return True


def _write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=1).encode()
    write_atomic(path, lambda f: f.write(text))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
