"""bench_model.py --mode time-to-quality on the CPU: two recipes train a tiny model for a few seconds each, evaluated
every second with the clock stopped; the report, the curves, the computed target and what a stop keeps."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench_model
from benchmarking import quality
from benchmarking.quality_report import COLUMNS, CURVE_COLUMNS
from training.recipes import RECIPES

TINY = ["--mode", "time-to-quality", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
        "--context-lengths", "32", "--batch-size", "4", "--eval-batches", "2", "--device", "cpu"]
BUDGET_S = 3.0
ROOT = Path(bench_model.__file__).parent


@pytest.fixture(scope="module")
def compared(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("ttq")
    rows = bench_model.main([*TINY, "--recipes", "adamw,muon", "--data", str(text_file), "--minutes",
                             str(BUDGET_S / 60), "--eval-interval-s", "1", "--out", str(out)])
    return rows, out


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # the module's comparison (compared) trains two recipes
def test_each_recipe_trains_for_the_budget_with_evaluations_every_interval(compared):
    rows, out = compared
    assert [(r["recipe"], r["optimizer"], r["status"]) for r in rows] == [("adamw", "adamw", "ok"),
                                                                         ("muon", "muon", "ok")]
    curves = read_csv(out / "curves.csv")
    assert list(curves[0]) == list(CURVE_COLUMNS)
    for r in rows:
        points = [c for c in curves if c["recipe"] == r["recipe"]]
        clocks = [float(c["clock_s"]) for c in points]
        assert clocks[0] == 0.0 and clocks == sorted(clocks) and len(points) == r["evals"] >= 3
        assert BUDGET_S <= r["train_s"] == clocks[-1] < BUDGET_S + 5  # the last evaluation ends the budget
        assert [int(c["tokens"]) for c in points][-1] == r["tokens"] == r["steps"] * 4 * 32
        assert all(0 < float(c["val_bpb"]) < 9 for c in points)
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] is None  # the CPU: no peak FLOPs
        assert float(points[-1]["val_bpb"]) == r["final_bpb"] < float(points[0]["val_bpb"])  # it learned


@pytest.mark.slow  # the module's comparison (compared) trains two recipes
def test_the_target_is_the_first_recipes_final_value_and_each_says_when_it_got_there(compared):
    rows, out = compared
    adamw, muon = rows
    assert adamw["target_bpb"] == muon["target_bpb"] == adamw["final_bpb"]
    assert adamw["reached"] and adamw["speedup"] == 1.0
    curves = [c for c in read_csv(out / "curves.csv") if c["recipe"] == "adamw"]
    first = next(c for c in curves if float(c["val_bpb"]) <= adamw["target_bpb"])
    assert (adamw["time_to_target_s"], adamw["tokens_to_target"]) == (float(first["clock_s"]), int(first["tokens"]))
    md = (out / "results.md").read_text()
    assert md.startswith("# Time to quality\n\n`python bench_model.py --mode time-to-quality")
    assert f"Target: custom: {adamw['target_bpb']:.4f} bpb (adamw's final value)." in md
    assert f"- custom adamw: reached {adamw['target_bpb']:.4f} bpb after {adamw['time_to_target_s']:.1f} s" in md
    if muon["reached"]:
        assert f"- custom muon: reached {adamw['target_bpb']:.4f} bpb after" in md
    else:
        assert f"- custom muon: never reached {adamw['target_bpb']:.4f} bpb in" in md
    assert "![validation bits per byte against seconds of training](curves.png)" in md and "## Environment" in md


@pytest.mark.slow  # the module's comparison (compared) trains two recipes
def test_the_files_hold_the_rows_the_curves_and_each_recipes_configuration(compared):
    rows, out = compared
    table = read_csv(out / "results.csv")
    assert list(table[0]) == list(COLUMNS) and [t["recipe"] for t in table] == ["adamw", "muon"]
    assert float(table[1]["target_bpb"]) == rows[0]["final_bpb"]
    payload = json.loads((out / "results.json").read_text())
    assert [r["recipe"] for r in payload["rows"]] == ["adamw", "muon"]
    assert len(payload["curves"]) == sum(r["evals"] for r in rows)
    resolved = payload["config"]["resolved"]
    assert resolved["custom muon"]["optim"]["optimizer"] == "muon" and not resolved["custom muon"]["execution"][
        "cuda_graph"]
    assert resolved["custom adamw"]["model"] == {**resolved["custom muon"]["model"]}  # the same model
    assert resolved["custom adamw"]["model"]["vocab_size"] == 256  # the data's
    assert payload["config"]["budget_s"] == BUDGET_S and payload["config"]["interval_s"] == 1.0
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow  # bench_model.py trains for seconds
def test_a_stop_keeps_what_was_measured_and_resume_goes_on(tmp_path, text_file, monkeypatch, capsys):
    """SIGTERM or Ctrl-C during the second recipe: exit 130, the first recipe's row whole, the second's evaluations
    so far, the files written; --resume then ends the comparison."""
    real, calls = quality.RecipeRun.train_step, {"muon": 0}

    def stopping(self, clock_s, budget_s):
        if self.label == "muon":
            calls["muon"] += 1
            if calls["muon"] == 2:  # the first step always runs: the budget (4 s) is not spent before it
                raise KeyboardInterrupt("signal SIGTERM")
        return real(self, clock_s, budget_s)

    monkeypatch.setattr(quality.RecipeRun, "train_step", stopping)
    with pytest.raises(SystemExit) as e:
        bench_model.main([*TINY, "--recipes", "adamw,muon", "--data", str(text_file), "--minutes", str(4 / 60),
                          "--eval-interval-s", "1", "--out", str(tmp_path)])
    assert e.value.code == 130
    table = read_csv(tmp_path / "results.csv")
    assert [(t["recipe"], t["status"]) for t in table] == [("adamw", "ok"), ("muon", "interrupted")]
    assert table[1]["message"].startswith("stopped after") and int(table[1]["steps"]) == 1
    curves = read_csv(tmp_path / "curves.csv")
    muon = [c["step"] for c in curves if c["recipe"] == "muon"]  # its evaluations before the stop
    assert muon[0] == "0" and set(muon) <= {"0", "1"}
    assert len([c for c in curves if c["recipe"] == "adamw"]) == int(table[0]["evals"]) >= 3
    assert re.search(r"\n- custom muon: .* \[interrupted: stopped after .* s of 4\]\n",
                     (tmp_path / "results.md").read_text())

    # The same command again is refused; with --resume it keeps adamw's row and trains muon on from its last snapshot.
    monkeypatch.setattr(quality.RecipeRun, "train_step", real)
    argv = [*TINY, "--recipes", "adamw,muon", "--data", str(text_file), "--minutes", str(4 / 60),
            "--eval-interval-s", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        bench_model.main(argv)
    assert "holds a stopped time-to-quality comparison: continue it with --resume" in capsys.readouterr().err
    rows = bench_model.main([*argv, "--resume"])
    assert [(r["recipe"], r["status"]) for r in rows] == [("adamw", "ok"), ("muon", "ok")]
    assert rows[0]["steps"] == int(table[0]["steps"]) and rows[0]["final_bpb"] == float(table[0]["final_bpb"])
    assert rows[1]["train_s"] >= 4 and not (tmp_path / "resume").exists()


@pytest.mark.parametrize("argv, message", [
    (["--mode", "time-to-quality,train-step"], "--mode time-to-quality runs alone (got time-to-quality,train-step)"),
    (["--optimizer", "muon"], "--optimizer does not apply to --mode time-to-quality: each recipe names its optimizer"),
    (["--recipes", "lion"], f"--recipes: 'lion' is neither a recipe ({', '.join(RECIPES)}) nor a JSON file"),
    (["--attn", "naive,sdpa"], "--attn: --mode time-to-quality compares recipes on one configuration; give one value"),
    (["--minutes", "0"], "--minutes must be > 0 and finite, got 0"),
    (["--minutes", "inf"], "--minutes must be > 0 and finite, got inf"),
    (["--minutes", "twenty"], "--minutes: 'twenty' is not a number"),
    (["--minutes", "20,10,5"], "--minutes: give one value, or one for each of the 2 --recipes; got 3"),
    (["--recipes", "adamw,adamw", "--minutes", "20,10"], "--minutes: one value per recipe needs each recipe once in "
                                                         "--recipes"),
    (["--eval-interval-s", "-1"], "--eval-interval-s must be > 0, got -1"),
    (["--cuda-graph", "on"], "recipe adamw: --cuda-graph: CUDA graphs need a GPU"),
    (["--devices", "cpu,gpu"], "--devices: 'gpu' is not a device (cpu, cuda:0, ...)"),
    (["--devices", "cpu,cuda:0"], "--devices: cuda:0 is not a cpu device, as --device cpu is"),
    (["--stop-at-target", "--devices", "cpu,cpu"], "--stop-at-target with --devices needs --target-bpb: side by side, "
                                                   "the first recipe's final value is not known while the others train"),
    (["--resume"], "--resume: --out {out} holds no stopped comparison ({out}/resume has no plan.json)"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench_model.main([*TINY, "--out", str(tmp_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {message.format(out=tmp_path)}\n"


def test_a_target_never_reached_is_said(tmp_path, text_file):
    rows = bench_model.main([*TINY, "--recipes", "adamw", "--data", str(text_file), "--minutes", str(1 / 60),
                             "--eval-interval-s", "1", "--target-bpb", "0.5", "--out", str(tmp_path)])
    assert rows[0]["target_bpb"] == 0.5 and rows[0]["reached"] is False and rows[0]["time_to_target_s"] is None
    assert math.isfinite(rows[0]["final_bpb"])
    assert "- custom adamw: never reached 0.5000 bpb in" in (tmp_path / "results.md").read_text()


def test_minutes_give_each_recipe_its_own_budget(tmp_path, text_file, capsys):
    rows = bench_model.main([*TINY, "--recipes", "adamw,muon", "--data", str(text_file), "--minutes", str(1 / 60),
                             str(0.5 / 60), "--eval-interval-s", "1", "--out", str(tmp_path)])
    assert [r["budget_s"] for r in rows] == pytest.approx([1.0, 0.5])
    assert 1.0 <= rows[0]["train_s"] < 3.0 and 0.5 <= rows[1]["train_s"] < 2.5 and rows[1]["steps"] < rows[0]["steps"]
    assert "adamw 1 s, muon 0.5 s of training," in capsys.readouterr().out
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["config"]["budget_s"] == pytest.approx({"adamw": 1.0, "muon": 0.5})
    assert "| size | recipe | budget s | optimizer |" in (tmp_path / "results.md").read_text()


def test_devices_belong_to_time_to_quality(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_model.main(["--mode", "train-step", "--device", "cpu", "--devices", "cpu,cpu", "--out", str(tmp_path)])
    assert capsys.readouterr().err == ("error: --devices spreads --mode time-to-quality's recipes over devices; "
                                       "--parallel runs one model on several GPUs\n")


@pytest.mark.slow  # two processes each start Python and train
def test_recipes_side_by_side_report_each_in_the_plans_order(tmp_path, text_file, capsys):
    """Three recipes on two devices (processes): every outcome comes back in the plan's order with its curve, the
    target is the first recipe's final value, and the lines name the device that trained each."""
    recipe = tmp_path / "options.json"
    recipe.write_text('{"model": {"qk_norm": true, "mlp": "relu2"}}')
    rows = bench_model.main([*TINY, "--recipes", f"adamw,muon,{recipe}", "--data", str(text_file), "--minutes",
                             str(2 / 60), "--eval-interval-s", "1", "--devices", "cpu,cpu", "--out",
                             str(tmp_path / "out")])
    assert [(r["recipe"], r["status"]) for r in rows] == [("adamw", "ok"), ("muon", "ok"), ("options", "ok")]
    assert all(r["target_bpb"] == rows[0]["final_bpb"] and r["evals"] >= 2 and r["steps"] > 0 for r in rows)
    curves = read_csv(tmp_path / "out" / "curves.csv")
    assert {c["recipe"] for c in curves} == {"adamw", "muon", "options"}
    out = capsys.readouterr().out
    assert re.search(r"^\[cpu\] custom options: \d+/2 s, step \d+", out, re.M)
    assert "custom options: muon" not in out and "custom options: adamw lr 0.0006" in out
    assert "Recipes ran side by side, one at a time on each of cpu, cpu." in (tmp_path / "out" / "results.md").read_text()


def first_process_dies(index, device, settings, tasks, results):
    """A process that takes a recipe and ends at once (exit code 3), then the real processes."""
    from benchmarking import quality_devices

    if index == 0:
        recipe, _ = tasks.get()
        results.put(("taken", (recipe, index)))
        time.sleep(0.5)  # the queue's thread sends it, as it would during a recipe's seconds of training
        os._exit(3)
    quality_devices.work(index, device, settings, tasks, results)


@pytest.mark.slow  # two processes each start Python and train
def test_a_process_that_dies_is_an_error_row_and_the_others_go_on(tmp_path, text_file, monkeypatch):
    from benchmarking import quality_devices

    monkeypatch.setattr(quality_devices, "work", first_process_dies)
    (tmp_path / "slow.json").write_text('{"optim": {"lr": 0.0001}}')
    rows = bench_model.main([*TINY, "--recipes", f"adamw,muon,{tmp_path / 'slow.json'}", "--data", str(text_file),
                             "--minutes", str(1 / 60), "--eval-interval-s", "1", "--devices", "cpu,cpu",
                             "--target-bpb", "3", "--out", str(tmp_path / "out")])
    errors = [r for r in rows if r["status"] == "error"]
    assert len(rows) == 3 and len(errors) == 1 and all(r["status"] == "ok" for r in rows if r not in errors)
    assert errors[0]["message"] == "its process (cpu #0) ended with exit code 3 while training it"


@pytest.mark.slow  # two processes each start Python and train
def test_sigterm_to_the_whole_group_keeps_what_each_process_measured(tmp_path, text_file):
    """What `timeout` does: every process of the group gets SIGTERM. Each reports its recipe as interrupted with the
    evaluations it had; the benchmark exits 130 within seconds, the files written."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "bench_model.py", *TINY, "--recipes", "adamw,muon", "--data",
                             str(text_file), "--minutes", "1", "--eval-interval-s", "1", "--devices", "cpu,cpu",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = set()
    for line in proc.stdout:  # both processes have evaluated after some steps
        if re.match(r"\[cpu\] custom (adamw|muon): \d+/60 s, step [1-9]", line):
            seen.add(line.split()[2])
        if len(seen) == 2:
            break
    os.killpg(proc.pid, signal.SIGTERM)
    start = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - start < 30
    table = read_csv(out / "results.csv")
    assert [(t["recipe"], t["status"]) for t in table] == [("adamw", "interrupted"), ("muon", "interrupted")]
    assert all(int(t["evals"]) >= 2 for t in table)
    # Each process kept a snapshot at its recipe's last evaluation, for --resume.
    curves = read_csv(out / "curves.csv")
    for recipe in ("adamw", "muon"):
        last = [c["step"] for c in curves if c["recipe"] == recipe][-1]
        assert [p.name for p in (out / "resume" / f"custom-{recipe}").iterdir()] == [f"checkpoint-{last}.safetensors"]


def test_recipes_without_an_outcome_become_error_rows_naming_the_processes():
    from types import SimpleNamespace

    from benchmarking.quality_devices import Progress

    items = [(("s", spec), (None, frozenset())) for spec in ("adamw", "muon", "mine.json")]
    progress = Progress(items, taken={0: 1, 1: 0}, got={0: "adamw's outcome"})
    workers = [SimpleNamespace(name="cuda:0 #0", exitcode=-9), SimpleNamespace(name="cuda:1 #1", exitcode=0)]
    lost = progress.lost(workers, interrupted=False)
    assert {i: (o.recipe, o.status, o.message) for i, o in lost.items()} == {
        1: ("muon", "error", "its process (cuda:0 #0) ended with exit code -9 while training it"),
        2: ("mine", "error", "no outcome came back: the processes ended (cuda:0 #0: exit code -9, cuda:1 #1: exit "
                             "code 0)")}
    assert list(progress.lost(workers, interrupted=True)) == [1]  # a stop leaves the recipes not started unsaid
