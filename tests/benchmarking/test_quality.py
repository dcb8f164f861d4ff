"""benchmarking/quality.py and quality_report.py: the clock that evaluation stops, the schedule stretched over the
budget, recipes as configurations, and the target each recipe reaches (or never does)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from benchmarking import quality, quality_report, quality_state
from benchmarking.quality import Outcome, QualitySettings, RecipeRun
from model import ModelConfig
from training.config import Config, ConfigError
from training.data import open_source
from training.evaluation import Evaluation

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=256, context_length=32)
OVERRIDES = {("execution", "device"): "cpu", ("data", "batch_size"): 4, ("run", "eval_batches"): 2}


def settings(budget_s: float = 1.0, **changes) -> QualitySettings:
    """The settings of a comparison, `budget_s` for every recipe unless `budgets_s` gives each its own."""
    base = dict(sizes={"tiny": TINY}, recipes=["adamw", "muon"], data=None, interval_s=0.5, target_bpb=None, seed=0,
                eval_batches=2, overrides=OVERRIDES, cache_dir=None)
    given = {**base, **changes}
    given.setdefault("budgets_s", (budget_s,) * len(given["recipes"]))
    return QualitySettings(**given)


def test_a_recipe_is_its_sections_over_the_size_and_the_flags_win(tmp_path):
    config, explicit = quality.resolved_config("muon", TINY, OVERRIDES)
    assert (config.optim.optimizer, config.model, config.data.batch_size) == ("muon", TINY, 4)
    assert not config.execution.cuda_graph and {"optimizer", "lr", "batch_size"} <= explicit
    config, _ = quality.resolved_config("muon", TINY, {**OVERRIDES, ("optim", "grad_clip"): 0.5})
    assert config.optim.grad_clip == 0.5
    path = tmp_path / "wsd-like.json"
    path.write_text(json.dumps({"optim": {"lr": 1e-3, "warmup_steps": 5}}))
    config, explicit = quality.resolved_config(str(path), TINY, OVERRIDES)
    assert (config.optim.optimizer, config.optim.lr, config.optim.warmup_steps) == ("adamw", 1e-3, 5)
    assert "warmup_steps" in explicit and quality.recipe_label(str(path)) == "wsd-like"
    path.write_text(json.dumps({"optim": {"optimizer": "muon"}, "execution": {"parallel": "fsdp"}}))
    with pytest.raises(ConfigError, match="^recipe wsd-like: --optimizer muon updates whole parameters"):
        quality.resolved_config(str(path), TINY, OVERRIDES)


class FakeTime:
    """perf_counter for the quality module: a step takes 0.25 s, an evaluation 5 s."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def timed_by(monkeypatch, evaluate) -> FakeTime:
    """The quality module on a fake clock where a step takes 0.25 s, each run scored by `evaluate(run)`."""
    fake = FakeTime()
    monkeypatch.setattr(quality.time, "perf_counter", fake.perf_counter)
    real_step = RecipeRun.train_step

    def step(self, clock_s, budget_s):
        fake.now += 0.25
        return real_step(self, clock_s, budget_s)

    monkeypatch.setattr(RecipeRun, "train_step", step)
    monkeypatch.setattr(RecipeRun, "evaluate", evaluate)
    return fake


def test_the_clock_counts_training_alone_and_evaluates_at_each_interval(monkeypatch):
    def evaluate(run):
        fake.now += 5.0
        return Evaluation(4.0 - run.steps / 10, 1.0, 256)

    fake = timed_by(monkeypatch, evaluate)
    config, explicit = quality.resolved_config("adamw", TINY, OVERRIDES)
    run = quality.build_run("adamw", "tiny", config, explicit, _source(), 4)
    quality.train_for(run, budget_s=1.0, interval_s=0.5, say=lambda line: None)
    assert [(p["clock_s"], p["step"]) for p in run.points] == [(0.0, 0), (0.5, 2), (1.0, 4)]
    assert (run.train_s, run.steps, run.timed_steps) == (1.0, 4, 4)  # 15 s of evaluation, not on the clock
    assert [p["tokens"] for p in run.points] == [0, 2 * 128, 4 * 128]
    assert run.points[0]["train_loss"] is None and run.points[-1]["train_loss"] is not None


def test_stop_at_target_ends_each_later_recipe_at_its_first_evaluation_at_or_below_the_first_ones_final(
        monkeypatch, tmp_path, text_file):
    """Steps take 0.25 s of a fake clock; adamw's bits per byte fall by 0.125 a step, muon's by 0.25: adamw trains its
    2 s and ends at 3.0, which muon reaches at step 4 (1.0 s), where it stops."""
    def evaluate(run):
        bpb = 4.0 - run.steps * (0.125 if run.label == "adamw" else 0.25)
        return Evaluation(bpb, 1 / math.log(2), 256)  # loss in nats = bits per byte at this many bytes a token

    timed_by(monkeypatch, evaluate)
    said = []
    given = settings(data=str(text_file), cache_dir=tmp_path / "cache", budget_s=2.0, stop_at_target=True)
    (adamw, muon), _ = quality.compare(given, say=said.append)
    assert [p["clock_s"] for p in adamw.points] == [0.0, 0.5, 1.0, 1.5, 2.0] and adamw.train_s == 2.0
    assert [(p["clock_s"], p["step"]) for p in muon.points] == [(0.0, 0), (0.5, 2), (1.0, 4)]
    assert (muon.status, muon.train_s, muon.steps) == ("ok", 1.0, 4)
    assert "tiny muon: 3.0000 bpb, stopped at the target (--stop-at-target)" in said
    table = quality_report.rows([adamw, muon], given)
    assert [(r["reached"], r["time_to_target_s"], r["speedup"]) for r in table] == [(True, 2.0, 1.0),
                                                                                   (True, 1.0, 2.0)]
    assert quality_report.verdicts(table)[1] == ("tiny muon: reached 3.0000 bpb after 1.0 s, 512 tokens, step 4 (2.00x "
                                                 "the speed of adamw) [ok: stopped at the target (--stop-at-target)]")
    (adamw, muon), _ = quality.compare(dataclasses.replace(given, target_bpb=3.5), say=said.append)
    assert [p["clock_s"] for p in adamw.points][-1] == 1.0 and [p["clock_s"] for p in muon.points][-1] == 0.5

    # A run resumed from a snapshot taken at the target stops before its warm-up steps train anything.
    monkeypatch.setattr(quality, "warm_up_steps", lambda config: 2)
    config, explicit = quality.resolved_config("muon", TINY, OVERRIDES)
    run = quality.build_run("muon", "tiny", config, explicit, _source(), 4)
    run.points = [{"clock_s": 1.0, "step": 4, "val_bpb": 2.9}]
    quality.train_for(run, budget_s=2.0, interval_s=0.5, say=said.append, stop_bpb=3.0)
    assert (run.steps, run.points[-1]["step"], run.message) == (0, 4, quality.STOPPED)


@pytest.mark.parametrize("budgets_s", [(2.0, 1.0), (1.0, 2.0)])
def test_each_recipe_trains_for_its_own_budget_on_its_own_schedule(monkeypatch, tmp_path, text_file, budgets_s):
    """Steps take 0.25 s of a fake clock: each recipe trains its own seconds, and its learning rate ends its cosine
    decay with them; the report says each budget and measures both against the first recipe's final value."""
    def evaluate(run):  # adamw's bits per byte fall by 0.125 a step, muon's twice as fast
        return Evaluation(4.0 - run.steps * (0.125 if run.label == "adamw" else 0.25), 1 / math.log(2), 256)

    timed_by(monkeypatch, evaluate)
    rates, real_lr = {}, RecipeRun.lr
    monkeypatch.setattr(RecipeRun, "lr", lambda self, clock_s, budget_s: rates.setdefault(self.label, []).append(
        real_lr(self, clock_s, budget_s) / self.config.optim.lr) or rates[self.label][-1])
    given = settings(data=str(text_file), cache_dir=tmp_path / "cache", budgets_s=budgets_s)
    (adamw, muon), _ = quality.compare(given, say=lambda line: None)
    assert (adamw.train_s, muon.train_s) == budgets_s and (adamw.steps, muon.steps) == tuple(4 * b for b in budgets_s)
    short = "muon" if budgets_s[1] < budgets_s[0] else "adamw"
    long = "adamw" if short == "muon" else "muon"
    n = len(rates[short])
    assert rates[short][-1] < rates[long][n - 1]  # further down its decay at the same step: a shorter schedule
    table = quality_report.rows([adamw, muon], given)
    assert [r["budget_s"] for r in table] == list(budgets_s)
    assert [r["time_to_target_s"] for r in table] == [budgets_s[0], budgets_s[0] / 2]
    line = quality_report.settings_line(given, quality_report.targets([adamw, muon], given))
    assert (f"for adamw {budgets_s[0]:g} s, muon {budgets_s[1]:g} s of training (the clock" in line
            and "Each recipe's learning rate follows the schedule of its own budget." in line)
    assert given.budget_record == {"adamw": budgets_s[0], "muon": budgets_s[1]}
    assert settings(budget_s=2.0).budget_record == 2.0 and settings(budget_s=2.0).budget_words() == (
        "2 s of training each")
    dotted = settings(recipes=["adamw", "runs/lr1.5e-3.json"], budgets_s=budgets_s)  # labelled lr1.5e-3
    assert [dotted.budget_s(r) for r in ("adamw", "lr1.5e-3", "runs/lr1.5e-3.json")] == [*budgets_s, budgets_s[1]]
    with pytest.raises(ConfigError, match=r"^--recipes: two recipes are named 'x' \(the files' names\)"):
        settings(recipes=["a/x.json", "b/x.json"])


def test_every_recipe_is_scored_on_the_same_validation_rows_whatever_its_batch_size(tmp_path):
    path = tmp_path / "big-batch.json"
    path.write_text(json.dumps({"data": {"batch_size": 32}}))
    overrides = {k: v for k, v in OVERRIDES.items() if k != ("data", "batch_size")}
    assert quality.validation_rows(settings(overrides=overrides)) == 16  # train.py's default batch
    assert quality.validation_rows(settings()) == 4  # --batch-size given: every recipe's
    rows = []
    for spec in ("adamw", str(path)):
        config, explicit = quality.resolved_config(spec, TINY, overrides)
        run = quality.build_run(spec, "tiny", config, explicit, _source(), 16)
        rows.append([b.inputs for b in run.val_sampler.val(2)])
    assert run.sampler.batch_size == 32 and rows[0][0].shape == (16, TINY.context_length)
    assert all(torch.equal(a, b) for a, b in zip(*rows))


def _source():
    """Synthetic tokens, which say each token is one byte (bits per byte need that)."""
    source = open_source("synthetic", TINY.context_length, None, vocab_size=256)
    return dataclasses.replace(source, token_bytes=np.ones(256, dtype=np.int64))


def test_the_learning_rate_warms_up_then_decays_to_the_floor_as_the_budget_ends():
    config, _ = quality.resolved_config("adamw", TINY, OVERRIDES)
    run = RecipeRun("adamw", "tiny", config, None, None, None, None, explicit_warmup=False)
    lr, floor = config.optim.lr, config.optim.min_lr
    assert run.lr(0.0, 10.0) == pytest.approx(lr / 100)  # no speed yet: a long run's first warm-up step
    run.steps = run.timed_steps = 100
    assert run.lr(5.0, 10.0) == pytest.approx(floor + 0.5 * (lr - floor) * (1 + torch.cos(
        torch.tensor(torch.pi * 80 / 180)).item()))  # 200 steps planned, warm-up 20: cosine at 80 of 180
    assert run.lr(10.0, 10.0) == pytest.approx(floor, rel=1e-2)  # the budget's end: the floor (its last step)
    run.explicit_warmup, run.steps, run.timed_steps = True, 0, 0
    assert run.lr(0.0, 10.0) == pytest.approx(lr / config.optim.warmup_steps)


def outcome(recipe: str, bpbs: list[float], size: str = "tiny", status: str = "ok") -> Outcome:
    config = Config(model=TINY).replace(execution={"device": "cpu", "dtype": "fp32"}, data={"batch_size": 4})
    points = [{"size": size, "recipe": recipe, "clock_s": 10.0 * i, "step": 5 * i, "tokens": 5 * i * 128,
               "train_loss": None, "val_loss": b * 0.69, "val_bpb": b} for i, b in enumerate(bpbs)]
    return Outcome(size, recipe, config, points, steps=5 * (len(bpbs) - 1), timed_steps=5 * (len(bpbs) - 1),
                   train_s=10.0 * (len(bpbs) - 1), status=status)


def test_the_target_is_the_first_recipes_final_value_or_the_one_given():
    outcomes = [outcome("adamw", [8.0, 5.0, 4.0, 3.0]), outcome("muon", [8.0, 4.0, 2.9, 2.5]),
                outcome("slow", [8.0, 6.0, 5.0, 4.0])]
    three = ["adamw", "muon", "slow"]
    table = quality_report.rows(outcomes, settings(recipes=three))
    assert [r["target_bpb"] for r in table] == [3.0] * 3
    assert [(r["reached"], r["time_to_target_s"], r["tokens_to_target"]) for r in table] == [
        (True, 30.0, 15 * 128), (True, 20.0, 10 * 128), (False, None, None)]
    assert [r["speedup"] for r in table] == [1.0, 1.5, None]
    assert [r["final_bpb"] for r in table] == [3.0, 2.5, 4.0]
    assert table[0]["ms_per_step"] == pytest.approx(2000.0) and table[0]["tokens_per_s"] == pytest.approx(64.0)
    assert quality_report.verdicts(table) == [
        "tiny adamw: reached 3.0000 bpb after 30.0 s, 1,920 tokens, step 15",
        "tiny muon: reached 3.0000 bpb after 20.0 s, 1,280 tokens, step 10 (1.50x the speed of adamw)",
        "tiny slow: never reached 3.0000 bpb in 30 s of training (final 4.0000 bpb)"]
    given = quality_report.rows(outcomes, settings(recipes=three, target_bpb=4.5))
    assert [r["time_to_target_s"] for r in given] == [20.0, 10.0, 30.0]
    assert quality_report.targets(outcomes, settings(recipes=three, target_bpb=4.5)) == {"tiny": (4.5, "--target-bpb")}


def test_a_diverged_first_recipe_still_gives_a_target_from_its_last_finite_evaluation():
    outcomes = [outcome("adamw", [8.0, 5.0, float("nan")], status="diverged"), outcome("muon", [8.0, 4.0, 3.0])]
    goal = quality_report.targets(outcomes, settings())
    assert goal == {"tiny": (5.0, "adamw's final value")}
    table = quality_report.rows(outcomes, settings())
    assert table[0]["status"] == "diverged" and table[1]["time_to_target_s"] == 10.0
    assert quality_report.targets([Outcome("tiny", "adamw", None, [], status="OOM")], settings()) == {
        "tiny": (None, "none: the first recipe has no evaluation")}


def test_the_curves_plot_one_line_per_recipe_and_the_target(tmp_path):
    outcomes = [outcome("adamw", [8.0, 5.0, 3.0]), outcome("muon", [8.0, 4.0, 2.5])]
    curves = [p for o in outcomes for p in o.points]
    path = quality_report.plot_curves(curves, {"tiny": (3.0, "adamw's final value")}, tmp_path / "curves.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    assert quality_report.plot_curves([], {}, tmp_path / "none.png") is None


def test_a_stopped_comparison_resumes_where_its_last_evaluation_was_and_ends_as_an_unstopped_one(
        monkeypatch, tmp_path, text_file):
    """Steps take 0.25 s of a fake clock. One comparison runs through; another stops during muon's 6th step (its
    last snapshot: the evaluation at 1.0 s, step 4), then resumes: adamw's outcome is kept and muon continues from
    step 4, so that every evaluation of both equals the unstopped comparison's."""
    fake, stop_at = FakeTime(), {"step": None}
    monkeypatch.setattr(quality.time, "perf_counter", fake.perf_counter)
    real_step = RecipeRun.train_step

    def step(self, clock_s, budget_s):
        fake.now += 0.25
        if self.label == "muon" and self.steps == stop_at["step"]:
            raise KeyboardInterrupt("signal SIGTERM")
        return real_step(self, clock_s, budget_s)

    monkeypatch.setattr(RecipeRun, "train_step", step)
    common = dict(data=str(text_file), cache_dir=tmp_path / "cache", budget_s=2.0, interval_s=0.5)
    through, stopped = tmp_path / "through", tmp_path / "stopped"
    expected, interrupted = quality.compare(settings(out=through, **common), say=lambda line: None)
    assert not interrupted and not (through / "resume").exists()  # an ended comparison leaves no state

    stop_at["step"] = 5
    outcomes, interrupted = quality.compare(settings(out=stopped, **common), say=lambda line: None)
    assert interrupted and [o.status for o in outcomes] == ["ok", "interrupted"]
    state = stopped / "resume"
    assert sorted(p.name for p in state.iterdir()) == ["data.json", "plan.json", "tiny-adamw.json", "tiny-muon"]
    assert [p.name for p in (state / "tiny-muon").iterdir()] == ["checkpoint-4.safetensors"]

    stop_at["step"] = None
    said = []
    resumed, interrupted = quality.compare(settings(out=stopped, resume=True, **common), say=said.append)
    assert not interrupted and not state.exists()
    assert "tiny adamw: ok, kept from the stopped comparison" in said
    assert "tiny muon: resumed at 1.0 s of training, step 4" in said
    for a, b in zip(expected, resumed, strict=True):
        assert (a.recipe, a.status, a.steps, a.timed_steps, a.train_s) == (b.recipe, b.status, b.steps,
                                                                           b.timed_steps, b.train_s)
        assert [(p["clock_s"], p["step"], p["tokens"]) for p in a.points] == [
            (p["clock_s"], p["step"], p["tokens"]) for p in b.points]
        assert [p["val_bpb"] for p in b.points] == pytest.approx([p["val_bpb"] for p in a.points], rel=1e-6)


def test_resume_holds_each_recipe_that_has_trained_to_its_budget_and_configuration(tmp_path):
    """An outcome or a snapshot kept means the recipe has trained: its budget and configuration must stay; one with
    neither may change them. A plan from other code (a field added since) or without a budget is named."""
    source = _source()

    def begin(resume=False, **changes):
        given = settings(out=tmp_path, resume=resume, **changes)
        quality_state.begin(given, quality.configs(given, {TINY.context_length: source}), 4, source)

    state = tmp_path / "resume"
    begin(budgets_s=(60.0, 30.0))
    (state / "tiny-adamw.json").write_text("{}")  # adamw ended; muon has neither an outcome nor a snapshot
    begin(resume=True, budgets_s=(60.0, 45.0))
    plan = json.loads((state / "plan.json").read_text())
    assert plan["budget_s"] == {"tiny-adamw": 60.0, "tiny-muon": 45.0}
    with pytest.raises(ConfigError, match=r"other --minutes \(tiny-adamw's 1 min then, 0.75 now\)"):
        begin(resume=True, budgets_s=(45.0, 45.0))
    (state / "tiny-muon").mkdir()  # a snapshot: muon has trained too
    with pytest.raises(ConfigError, match=r"other --minutes \(tiny-muon's 0.75 min then, 0.5 now\)"):
        begin(resume=True, budgets_s=(60.0, 30.0))

    saved = json.loads(json.dumps(plan))
    del saved["recipes"]["tiny-adamw"]["optim"]["lr"]
    (state / "plan.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"other --recipes and --sizes \(tiny-adamw's optim lr: absent then, 0.0006 "
                                          r"now\)"):
        begin(resume=True, budgets_s=(60.0, 45.0))
    del plan["budget_s"]
    (state / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match=rf"^--resume: {state / 'plan.json'} cannot be read \(no budget for "
                                          r"tiny-adamw\)$"):
        begin(resume=True, budgets_s=(60.0, 45.0))


def test_a_stop_during_the_warm_up_steps_is_an_interruption_that_resume_trains_again(monkeypatch, tmp_path, text_file):
    monkeypatch.setattr(quality, "warm_up_steps", lambda config: 2)  # as compile or a CUDA graph asks
    monkeypatch.setattr(RecipeRun, "train_step", lambda self, clock_s, budget_s: (_ for _ in ()).throw(
        KeyboardInterrupt("signal SIGTERM")))
    given = settings(recipes=["muon"], data=str(text_file), cache_dir=tmp_path / "cache", out=tmp_path)
    (outcome,), interrupted = quality.compare(given, say=lambda line: None)
    assert interrupted and (outcome.status, outcome.points) == ("interrupted", [])
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["data.json", "plan.json"]  # none ended

    monkeypatch.setattr(quality_state.RecipeState, "restore", lambda state, run: (_ for _ in ()).throw(
        KeyboardInterrupt("signal SIGTERM")))  # as while a snapshot loads
    (outcome,), interrupted = quality.compare(dataclasses.replace(given, resume=True), say=lambda line: None)
    assert interrupted and (outcome.status, outcome.message) == ("interrupted", "stopped before it trained")
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["data.json", "plan.json"]


def test_resume_refuses_another_plan_naming_what_differs(monkeypatch, tmp_path, text_file):
    real_resolved = quality.resolved_config
    monkeypatch.setattr(RecipeRun, "train_step", lambda self, clock_s, budget_s: (_ for _ in ()).throw(
        KeyboardInterrupt("signal SIGTERM")))
    data = tmp_path / "corpus.txt"
    data.write_bytes(text_file.read_bytes())
    common = dict(data=str(data), cache_dir=tmp_path / "cache", out=tmp_path, interval_s=0.5)
    _, interrupted = quality.compare(settings(budget_s=60.0, **common), say=lambda line: None)
    assert interrupted and (tmp_path / "resume" / "plan.json").is_file()
    with pytest.raises(ConfigError, match=rf"^--resume: the stopped comparison in {tmp_path} had other --minutes "
                                          r"\(tiny-adamw's 1 min then, 2 now\); give the flags it had"):
        quality.compare(settings(budget_s=120.0, resume=True, **common), say=lambda line: None)
    with pytest.raises(ConfigError, match=r"other --recipes and --sizes \(tiny-adamw, tiny-muon then, tiny-muon, "
                                          r"tiny-adamw now\)"):
        quality.compare(settings(budget_s=60.0, resume=True, recipes=["muon", "adamw"], **common),
                        say=lambda line: None)
    lr = {**OVERRIDES, ("optim", "lr"): 1e-2}
    with pytest.raises(ConfigError, match=r"other --recipes and --sizes \(tiny-adamw's optim lr: 0.0006 then, 0.01 "
                                          r"now\)"):
        quality.compare(settings(budget_s=60.0, resume=True, overrides=lr, **common), say=lambda line: None)
    with pytest.raises(ConfigError, match=r"other --stop-at-target \(False then, True now\)"):
        quality.compare(settings(budget_s=60.0, resume=True, stop_at_target=True, **common), say=lambda line: None)
    with pytest.raises(ConfigError, match=r"other --target-bpb \(None then, 3.0 now\)"):
        quality.compare(settings(budget_s=60.0, resume=True, target_bpb=3.0, **common), say=lambda line: None)
    plan = json.loads((tmp_path / "resume" / "plan.json").read_text())
    for name in ("stop_at_target", "target_bpb"):  # a plan written before these settings existed: without them
        del plan[name]
    (tmp_path / "resume" / "plan.json").write_text(json.dumps(plan))
    _, interrupted = quality.compare(settings(budget_s=60.0, resume=True, **common), say=lambda line: None)
    assert interrupted  # resumed, and stopped by the first step again
    # muon has not trained (adamw was stopped): its budget and configuration may change, and the plan says so
    muon_lr = {**OVERRIDES, ("optim", "lr"): 1e-2}
    changed = dict(budgets_s=(60.0, 30.0), resume=True, recipes=["adamw", "muon"], **common)
    monkeypatch.setattr(quality, "resolved_config", lambda spec, model, overrides: real_resolved(
        spec, model, muon_lr if spec == "muon" else overrides))
    _, interrupted = quality.compare(settings(**changed), say=lambda line: None)
    plan = json.loads((tmp_path / "resume" / "plan.json").read_text())
    assert interrupted and plan["budget_s"] == {"tiny-adamw": 60.0, "tiny-muon": 30.0}
    assert plan["recipes"]["tiny-muon"]["optim"]["lr"] == 1e-2
    monkeypatch.setattr(quality, "resolved_config", real_resolved)
    data.write_text(data.read_text()[::-1])  # the same path, other text
    with pytest.raises(ConfigError, match=rf"^--resume: --data {data} \(.*\) is not the data the stopped "
                                          rf"comparison in {tmp_path} trained on \(recorded in {tmp_path}/resume/"
                                          r"data.json\); give that data"):
        quality.compare(settings(budget_s=60.0, resume=True, **common), say=lambda line: None)
