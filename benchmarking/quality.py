"""Time to quality: how long each recipe takes to bring a model to a validation bits per byte.

`bench_model.py --mode time-to-quality --recipes adamw,muon --data DIR --minutes 20 --eval-interval-s 60` trains,
for each model size and each recipe (training/recipes.py, or a JSON file of config sections), the same model from
the same seed on the same data and batches, with the recipe's step built by training.step.build_step from its
resolved configuration, as train.py builds it, for a wall-clock budget: one for every recipe, or one each (`--minutes
20,10`: does the second recipe reach the first one's final value in half its time?). The clock counts training alone:

- the first steps, which compile and capture the CUDA graph (training.step.warm_up_steps), are timed apart, as
  train.py's logged step times are;
- every --eval-interval-s seconds of training the clock stops (after a synchronise), validation bits per byte are
  measured on the same fixed batches for every recipe, and the clock restarts: evaluation costs no budget.

The learning rate follows the recipe's warm-up and cosine decay over the steps the budget holds at the speed
measured so far, so that it reaches --min-lr as the budget ends (train.py's schedule, with --steps estimated).
The target is the first recipe's final bits per byte (or --target-bpb); each recipe's time and tokens to reach it
are those of its first evaluation at or below it (a resolution of --eval-interval-s); with --stop-at-target a recipe
stops there (its schedule still that of the whole budget), which saves the rest of the budget of every recipe but the
one that sets the target. A stopped comparison continues with --resume from the state kept in --out
(quality_state.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarking import quality_state
from benchmarking.oom import free_memory
from benchmarking.quality_state import RecipeState
from benchmarking.timing import synchronize
from model import ModelConfig, TransformerLM
from training import cli
from training.config import Config, ConfigError, DataConfig, default_warmup_steps, resolve
from training.data import DataSource, open_source, vocab_of
from training.data.sampling import Sampler
from training.evaluation import Evaluation, evaluate
from training.optim.schedule import lr_at
from training.recipes import RECIPES
from training.step import TrainingStep, build_step, warm_up_steps
from training.trainer import split

Say = Callable[[str], None]
ENDED = ("ok", "diverged", "OOM")  # outcomes a resumed comparison keeps; it trains the others (interrupted, error) again
UNKNOWN_STEPS = 10**9  # a run's length before its speed is known
STOPPED = "stopped at the target (--stop-at-target)"  # the message of a run that did


@dataclass(frozen=True)
class QualitySettings:
    """What every recipe of one comparison shares."""

    sizes: dict[str, ModelConfig]  # the model of each size, its context length set (the vocabulary is the data's)
    recipes: list[str]  # recipe names or JSON files
    data: Optional[str]  # --data: None is the built-in corpus
    budgets_s: tuple[float, ...]  # seconds of training of each recipe, in the order of `recipes`
    interval_s: float
    target_bpb: Optional[float]
    seed: int
    eval_batches: int
    overrides: dict[tuple[str, str], Any]  # (section, field) -> value of the flags given, over each recipe
    cache_dir: Path  # the token cache of text data
    devices: tuple[str, ...] = ()  # more than one: recipes side by side, one per device (quality_devices.py)
    out: Optional[Path] = None  # --out, where the comparison's state is kept as it runs (quality_state.py); None: not
    resume: bool = False  # continue the stopped comparison in `out`
    stop_at_target: bool = False  # a recipe stops at its first evaluation at or below the target (stop_bpb)

    def __post_init__(self):
        if len(self.budgets_s) != len(self.recipes):
            raise ValueError(f"QualitySettings: {len(self.budgets_s)} budgets_s for {len(self.recipes)} recipes")
        labels = [recipe_label(spec) for spec in self.recipes]
        if len(set(labels)) < len(labels):
            twice = next(label for label in labels if labels.count(label) > 1)
            raise ConfigError(f"--recipes: two recipes are named {twice!r} (the files' names): rename one, so that "
                              "each has its own results")

    def budget_s(self, recipe: str) -> float:
        """Seconds of training of `recipe`: a spec of `recipes`, or its label."""
        return self.budgets_by_label[recipe if recipe in self.budgets_by_label else recipe_label(recipe)]

    @property
    def budgets_by_label(self) -> dict[str, float]:
        return {recipe_label(spec): b for spec, b in zip(self.recipes, self.budgets_s)}

    @property
    def common_budget_s(self) -> Optional[float]:
        """The budget of every recipe, or None when they differ."""
        return self.budgets_s[0] if len(set(self.budgets_s)) == 1 else None

    @property
    def budget_record(self) -> float | dict[str, float]:
        """The budget as results.json holds it: seconds, or seconds by recipe label when they differ."""
        return self.common_budget_s if self.common_budget_s is not None else self.budgets_by_label

    def budget_words(self) -> str:
        """'1200 s of training each', or 'adamw 1200 s, speedrun 600 s of training'."""
        if self.common_budget_s is not None:
            return f"{self.common_budget_s:g} s of training each"
        return f"{', '.join(f'{label} {b:g} s' for label, b in self.budgets_by_label.items())} of training"


def recipe_label(spec: str) -> str:
    """A recipe's name, or a JSON file's stem."""
    return spec if spec in RECIPES else Path(spec).stem


def recipe_config(spec: str, model: ModelConfig, overrides: dict[tuple[str, str], Any]) -> tuple[Config, frozenset]:
    """The configuration of one recipe: the size's model, the recipe's sections, then the flags given; and the fields
    set (which decide some defaults). Resolved by the caller, as train.py resolves its command line."""
    sections = cli.flatten(cli.read_config(spec))
    config = cli.apply(Config(model=model), {**sections, **overrides})
    return config, frozenset(name for _, name in [*sections, *overrides])


def resolved_config(spec: str, model: ModelConfig, overrides: dict[tuple[str, str], Any]) -> tuple[Config, frozenset]:
    """recipe_config, resolved for one process (ConfigError names the recipe), and the fields it set."""
    config, explicit = recipe_config(spec, model, overrides)
    try:
        return resolve(config, explicit, world_size=1).config, explicit
    except ConfigError as e:
        raise ConfigError(f"recipe {recipe_label(spec)}: {e}") from None


# ------------------------------------------------------------------------------------------------ one recipe


class Clock:
    """Seconds of training: runs between start() and stop(); stop() synchronises first, so that the queued steps
    count. read() is the host's view, without synchronising: step_done() keeps the GPU at most LEAD steps behind
    the host, so that the host's view is that close to the truth (a replayed CUDA graph is one launch: unbounded,
    the host would queue hundreds of steps and overrun the budget by as many) while the GPU always has work queued."""

    LEAD = 2

    def __init__(self, device: torch.device):
        self.device, self.total, self._since = device, 0.0, None
        self._queued: deque = deque()

    def step_done(self) -> None:
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        self._queued.append(event)
        if len(self._queued) > self.LEAD:
            self._queued.popleft().synchronize()

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        self._queued.clear()  # all done
        if self._since is not None:
            self.total += time.perf_counter() - self._since
        self._since = None
        return self.total

    def read(self) -> float:
        return self.total + (time.perf_counter() - self._since if self._since is not None else 0.0)


@dataclass
class RecipeRun:
    """One recipe's training: its step, data and figures so far."""

    label: str
    size: str
    config: Config
    step: TrainingStep
    sampler: Sampler
    val_sampler: Sampler  # the validation rows: the same for every recipe, whatever its batch size
    token_bytes: torch.Tensor
    explicit_warmup: bool  # the recipe or a flag set --warmup-steps; else the budget's default
    points: list[dict[str, Any]] = field(default_factory=list)  # one per evaluation
    steps: int = 0  # all steps, warm-up ones included
    timed_steps: int = 0  # the steps on the clock
    train_s: float = 0.0  # the clock: seconds of training
    warmup_s: float = 0.0
    status: str = "ok"  # ok, diverged, interrupted, OOM, error
    message: str = ""

    def lr(self, clock_s: float, budget_s: float) -> float:
        """The recipe's schedule (train.py's) over the steps that the budget holds at the speed so far."""
        o = self.config.optim
        if self.timed_steps and clock_s > 0:
            left = (budget_s - clock_s) * self.timed_steps / clock_s
            planned = max(self.steps + 1, round(self.steps + left))
        else:  # no speed measured yet (the warm-up steps): the start of a long run's schedule
            planned = UNKNOWN_STEPS
        warmup = o.warmup_steps if self.explicit_warmup else default_warmup_steps(planned)
        return lr_at(self.steps, o.lr, o.min_lr, warmup, planned)

    def train_step(self, clock_s: float, budget_s: float) -> torch.Tensor:
        self.step.set_lr(self.lr(clock_s, budget_s))
        batch = self.sampler.train(self.steps)
        loss, _ = self.step(batch.inputs, batch.targets, batch.doc_ids, want_norm=False)
        self.steps += 1
        return loss

    def evaluate(self) -> Evaluation:
        """Bits per byte on the fixed validation batches (the same for every recipe: drawn by seed and index)."""
        model, n = self.step.model, self.config.execution.grad_accum_steps
        model.eval()
        batches = (part for b in self.val_sampler.val(self.config.run.eval_batches) for part in split(b, n))
        result = evaluate(self.step.loss, batches, self.token_bytes)
        model.train()
        return result


def tokens_per_step(config: Config) -> int:
    return config.data.batch_size * config.model.context_length


def build_run(spec: str, size: str, config: Config, explicit: frozenset, source: DataSource,
              val_rows: int) -> RecipeRun:
    """The recipe's model (from the run's seed) and step, and the run's batches; `explicit`: the fields the recipe
    and the flags set; `val_rows`: the rows of each validation batch (validation_rows)."""
    device = torch.device(config.execution.device)
    if config.execution.compile:
        torch._dynamo.reset()  # fresh caches for each recipe: no recompile limit reached across them
    torch.manual_seed(config.run.seed)
    with device:
        model = TransformerLM(config.model, config.execution.attn)
    step = build_step(model, config)
    sampler = Sampler(source, config.data.batch_size, config.model.context_length, config.run.seed,
                      device=device, packed=config.data.pack_documents)
    token_bytes = torch.as_tensor(source.token_bytes, device=device)
    val_sampler = dataclasses.replace(sampler, batch_size=val_rows)
    return RecipeRun(recipe_label(spec), size, config, step, sampler, val_sampler, token_bytes,
                     "warmup_steps" in explicit)


def validation_rows(settings: QualitySettings) -> int:
    """Sequences in each validation batch, for every recipe: --batch-size if given, else train.py's default. A
    recipe's own batch size must not choose them: other rows are other text, and their bits per byte differ."""
    return settings.overrides.get(("data", "batch_size"), DataConfig().batch_size)


def record(run: RecipeRun, clock: Clock, loss: Optional[torch.Tensor], state: Optional[RecipeState] = None) -> bool:
    """Evaluate with the clock stopped (the caller restarts it), then keep a snapshot in `state`; False once the run
    diverged."""
    clock_s = clock.stop()
    result = run.evaluate()
    train_loss = None if loss is None else float(loss)
    run.points.append({"size": run.size, "recipe": run.label, "clock_s": clock_s, "step": run.steps,
                       "tokens": run.steps * tokens_per_step(run.config), "train_loss": train_loss,
                       "val_loss": result.loss, "val_bpb": result.bpb})
    if math.isfinite(result.loss) and (train_loss is None or math.isfinite(train_loss)):
        if state is not None:
            run.train_s = clock_s
            state.snapshot(run)
        return True
    bad = result.loss if train_loss is None or math.isfinite(train_loss) else train_loss
    run.status, run.message = "diverged", f"the loss became {bad} at step {run.steps}"
    return False


def warm_up(run: RecipeRun, budget_s: float, say: Say) -> None:
    """The steps that compile and capture (trained on, as train.py's, but timed apart), at the start or on resuming."""
    n = warm_up_steps(run.config)
    start = time.perf_counter()
    for _ in range(n):
        run.train_step(run.train_s, budget_s)
    synchronize(run.step.device)
    seconds = time.perf_counter() - start
    run.warmup_s += seconds
    if n:
        say(f"{run.size} {run.label}: warm-up {seconds:.1f} s for {n} step{'s' * (n > 1)} (not on the clock)")


def train_for(run: RecipeRun, budget_s: float, interval_s: float, say: Say,
              state: Optional[RecipeState] = None, stop_bpb: Optional[float] = None) -> None:
    """Train until `budget_s` seconds of training, evaluating every `interval_s` of them (and at 0 and the end), from
    where `run` is (a resumed run's clock and evaluations); `state` keeps a snapshot at each evaluation; with
    `stop_bpb`, the first evaluation at or below it ends the run."""
    if reached(run, stop_bpb):  # a snapshot taken at the target, its outcome not yet kept
        stop_there(run, say)
        return
    clock, loss = Clock(run.step.device), None
    clock.total = run.train_s
    try:
        warm_up(run, budget_s, say)
        if not run.points and not record(run, clock, loss, state):
            return
        if reached(run, stop_bpb):
            stop_there(run, say)
            return
        next_eval = (math.floor(clock.total / interval_s) + 1) * interval_s
        clock.start()
        while clock.read() < budget_s:
            loss = run.train_step(clock.read(), budget_s)
            clock.step_done()
            run.timed_steps += 1
            if clock.read() >= next_eval:
                if not record(run, clock, loss, state):
                    return
                say(progress_line(run, budget_s))
                if reached(run, stop_bpb):
                    stop_there(run, say)
                    return
                next_eval = (math.floor(clock.total / interval_s) + 1) * interval_s
                clock.start()
        if not run.points or run.points[-1]["step"] != run.steps:
            record(run, clock, loss)
    except KeyboardInterrupt:
        clock.stop()
        run.status, run.message = "interrupted", f"stopped after {clock.total:.1f} s of {budget_s:g}"
        raise
    finally:
        run.train_s = clock.total


def reached(run: RecipeRun, stop_bpb: Optional[float]) -> bool:
    return stop_bpb is not None and bool(run.points) and run.points[-1]["val_bpb"] <= stop_bpb


def stop_there(run: RecipeRun, say: Say) -> None:
    run.message = STOPPED
    say(f"{run.size} {run.label}: {run.points[-1]['val_bpb']:.4f} bpb, {STOPPED}")


def stop_bpb(settings: QualitySettings, size: str, outcomes: list[Outcome]) -> Optional[float]:
    """Where a recipe of `size` stops with --stop-at-target: --target-bpb, else the final bits per byte of the size's
    first recipe once it has ended (recipes one after another; that one itself trains its whole budget)."""
    if not settings.stop_at_target:
        return None
    from benchmarking.quality_report import targets  # the report's target, the one its rows are judged by

    return targets(outcomes, settings)[size][0]


def progress_line(run: RecipeRun, budget_s: float) -> str:
    p = run.points[-1]
    return (f"{run.size} {run.label}: {p['clock_s']:.0f}/{budget_s:.0f} s, step {p['step']}, "
            f"{p['tokens']:,} tokens, val {p['val_loss']:.3f}, {p['val_bpb']:.3f} bpb")


# ------------------------------------------------------------------------------------------------ the comparison


@dataclass(frozen=True)
class Outcome:
    """What one recipe's run measured, once its model is released."""

    size: str
    recipe: str
    config: Optional[Config]  # None when the recipe could not even be built
    points: list[dict[str, Any]]
    steps: int = 0
    timed_steps: int = 0
    train_s: float = 0.0
    warmup_s: float = 0.0
    status: str = "ok"
    message: str = ""

    @classmethod
    def of(cls, run: RecipeRun) -> "Outcome":
        return cls(run.size, run.label, run.config, run.points, run.steps, run.timed_steps, run.train_s,
                   run.warmup_s, run.status, run.message)


def open_data(settings: QualitySettings, context_length: int) -> DataSource:
    """The data every recipe trains on; it must say how many bytes its tokens encode (bits per byte)."""
    source = open_source(settings.data, context_length, settings.cache_dir, seed=settings.seed)
    if source.token_bytes is None:
        raise ConfigError(f"--data {settings.data}: {source.description} does not say which text its tokens encode, "
                          "so it has no bits per byte; use text or a prepared directory (prepare_data.py)")
    return source


def configs(settings: QualitySettings,
            sources: dict[int, DataSource]) -> dict[tuple[str, str], tuple[Config, frozenset]]:
    """Every (size, recipe) configuration and the fields it sets, resolved before anything trains: a bad recipe
    fails at once."""
    out = {}
    for size, model in settings.sizes.items():
        vocab = vocab_of(sources[model.context_length], None)
        for spec in settings.recipes:
            model_v = ModelConfig.from_dict({**model.to_dict(), "vocab_size": vocab})
            out[size, spec] = resolved_config(spec, model_v, settings.overrides)
    return out


def run_one(spec: str, size: str, planned: tuple[Config, frozenset], source: DataSource, settings: QualitySettings,
            say: Say, outcomes: list[Outcome]) -> None:
    """Train one recipe and append its outcome to `outcomes`, whatever happens: an out-of-memory or another error is
    its outcome and the comparison goes on; a Ctrl-C propagates, the evaluations so far kept. With settings.out, the
    recipe's state is kept as it goes and (settings.resume) taken up: an outcome kept, a snapshot continued."""
    (config, explicit), run, failure = planned, None, None
    label = recipe_label(spec)
    state = RecipeState.of(settings, size, label) if settings.out is not None else None
    if state is not None and settings.resume and (kept := state.ended(config)) is not None:
        say(f"{size} {label}: {kept.status}, kept from the stopped comparison")
        outcomes.append(kept)
        return
    try:
        run = build_run(spec, size, config, explicit, source, validation_rows(settings))
        if state is not None and settings.resume and state.restore(run):
            say(f"{size} {label}: resumed at {run.train_s:.1f} s of training, step {run.steps}")
        train_for(run, settings.budget_s(spec), settings.interval_s, say, state, stop_bpb(settings, size, outcomes))
    except KeyboardInterrupt:
        if run is not None and run.status == "ok":  # stopped before training began (loading its snapshot)
            run.status, run.message = "interrupted", "stopped before it trained"
        raise
    except torch.OutOfMemoryError as e:
        failure = ("OOM", str(e).splitlines()[0][:300])
    except (RuntimeError, ValueError, ConfigError) as e:  # one broken recipe must not lose the others
        failure = ("error", f"{type(e).__name__}: {e}".splitlines()[0][:300])
    finally:
        if run is None:
            status, message = failure or ("interrupted", "stopped before its first step")
            outcome = Outcome(size, label, config, [], status=status, message=message)
        else:
            if failure:
                run.status, run.message = failure
            outcome = Outcome.of(run)
            run.step = None  # type: ignore[assignment]  # release the model and its optimizer before the next
        if state is not None and outcome.status in ENDED:
            state.save_outcome(outcome)
        outcomes.append(outcome)
        free_memory()


def compare(settings: QualitySettings, say: Say) -> tuple[list[Outcome], bool]:
    """Every size and recipe in turn, or side by side on settings.devices; (outcomes, whether a Ctrl-C or SIGTERM
    ended it early: then the recipe that was training keeps the evaluations it had)."""
    from benchmarking.interruption import sigterm_as_interrupt

    lengths = sorted({m.context_length for m in settings.sizes.values()})
    sources = {t: open_data(settings, t) for t in lengths}
    planned = configs(settings, sources)
    if settings.out is not None:
        quality_state.begin(settings, planned, validation_rows(settings), sources[lengths[0]])
    outcomes: list[Outcome] = []
    try:
        with sigterm_as_interrupt():
            if len(settings.devices) > 1:
                from benchmarking.quality_devices import side_by_side

                for (size, spec), (config, _) in planned.items():
                    say(plan_line(size, spec, config, settings))
                side_by_side(settings, planned, say, outcomes)
            else:
                for (size, spec), (config, explicit) in planned.items():
                    say(plan_line(size, spec, config, settings))
                    run_one(spec, size, (config, explicit), sources[config.model.context_length], settings, say,
                            outcomes)
        if settings.out is not None:
            quality_state.end(settings)
        return outcomes, False
    except KeyboardInterrupt:
        return outcomes, True


def plan_line(size: str, spec: str, config: Config, settings: QualitySettings) -> str:
    return (f"{size} {recipe_label(spec)}: {config.optim.optimizer} lr {config.optim.lr:g}, "
            f"{', '.join(execution_words(config))}; {settings.budget_s(spec):g} s of training")


def execution_words(config: Config) -> list[str]:
    ex = config.execution
    return [f"{ex.attn} {ex.dtype}", "compiled" if ex.compile else "eager",
            "CUDA graph" if ex.cuda_graph else "no CUDA graph"]
