"""End-to-end checks of train.py on the CPU with a tiny model."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import sample
import train
from tests.checkpoints import write_legacy
from tests.training.wandb_offline import history_and_summary
from training import cli
from training.checkpoint import format as checkpoint
from training.config import resolve
from training.step import TrainingStep

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--device", "cpu", "--warmup-steps", "5", "--lr", "3e-3", "--min-lr", "3e-4"]
ROOT = Path(train.__file__).parent


def read_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(tmp_path, text_file, *extra, name="run"):
    out = tmp_path / name
    code = train.main([*TINY, "--data", str(text_file), "--out", str(out), "--wandb", "disabled", *extra])
    return code, read_rows(out), out


def exit_status(argv: list[str]) -> int:
    """train.main's exit status, also when a flag's error exits through SystemExit."""
    try:
        return train.main(argv)
    except SystemExit as e:
        return e.code


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


@pytest.mark.slow  # 80 steps (the short runs below stay in the fast set)
def test_loss_falls(tmp_path, text_file):
    code, rows, out = run(tmp_path, text_file, "--steps", "80", "--log-every", "5", "--eval-every", "40")
    assert code == 0
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5, (rows[0]["loss"], rows[-1]["loss"])
    assert rows[-1]["val_loss"] < 3.5
    for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu"):
        assert key in rows[-1]
    assert rows[-1]["mfu"] is None  # no made-up MFU on the CPU
    assert checkpoint.load(out / "checkpoint-80.safetensors")["step"] == 80


@pytest.mark.slow  # train.py runs and resumes
def test_ctrl_c_checkpoints_and_resume_reproduces_losses(tmp_path, text_file, monkeypatch):
    args = ("--steps", "16", "--log-every", "1", "--eval-every", "0", "--ckpt-every", "100")
    code, straight, _ = run(tmp_path, text_file, *args, name="straight")
    assert code == 0 and [r["step"] for r in straight] == list(range(1, 17))

    real_loss, calls = TrainingStep.loss, {"n": 0}

    def loss_then_interrupt(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:  # Ctrl-C during step 7: the run finishes that step, checkpoints, stops
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*a, **k)

    monkeypatch.setattr(TrainingStep, "loss", loss_then_interrupt)
    code, _, out = run(tmp_path, text_file, *args, name="resumed")
    assert code == 130
    assert checkpoint.load(out / "checkpoint-7.safetensors")["step"] == 7
    monkeypatch.setattr(TrainingStep, "loss", real_loss)

    code, resumed, _ = run(tmp_path, text_file, *args, "--resume", name="resumed")
    assert code == 0 and [r["step"] for r in resumed] == list(range(1, 17))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    real_loss, calls = TrainingStep.loss, {"n": 0}

    def nan_at_step_7(*a, **k):
        calls["n"] += 1
        loss = real_loss(*a, **k)
        return loss * float("nan") if calls["n"] >= 7 else loss

    monkeypatch.setattr(TrainingStep, "loss", nan_at_step_7)
    code, _, out = run(tmp_path, text_file, "--steps", "20", "--ckpt-every", "5", "--log-every", "4")
    assert code == 1
    captured = capsys.readouterr()
    assert "loss became nan at step 8" in captured.err
    assert f"Last good checkpoint: {out / 'checkpoint-5.safetensors'} (step 5)" in captured.err
    assert checkpoint.load(out / "checkpoint-5.safetensors")["step"] == 5


@pytest.mark.slow  # train.py runs
def test_the_summary_names_the_checkpoint_the_wandb_run_and_commands_that_work(tmp_path, text_file, capsys):
    """An offline W&B run holds the logged keys; the summary names the checkpoint, the metrics, the W&B directory
    with its sync command, and sample/evaluate/resume commands, which run as printed."""
    out = tmp_path / "wb"
    code = train.main([*TINY, "--data", str(text_file), "--out", str(out), "--steps", "6", "--log-every", "3",
                       "--wandb", "offline"])
    assert code == 0
    history, summary = history_and_summary(out / "wandb", min_rows=3)
    assert [h["_step"] for h in history] == [1, 3, 6]  # the first step reports at once, then every --log-every
    for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s"):
        assert key in history[-1]
    assert "val_loss" in history[-1]
    assert summary["final_loss"] == history[-1]["loss"] and summary["steps"] == 6

    lines = capsys.readouterr().out.splitlines()
    rows = read_rows(out)
    [wandb_dir] = (out / "wandb").glob("offline-run-*")
    done = lines.index(next(line for line in lines if line.startswith("done: ")))
    assert re.fullmatch(r"done: step 6 of 6 in \d+\.\d s", lines[done]), lines[done]
    assert lines[done + 1:done + 5] == [
        f"final: train loss {rows[-1]['loss']:.4f}, val loss {rows[-1]['val_loss']:.4f}, "
        f"{rows[-1]['val_bpb']:.4f} bits per byte",
        f"checkpoint: {out / 'checkpoint-6.safetensors'}",
        f"metrics: {out / 'metrics.jsonl'}; config: {out / 'config.json'}",
        f"W&B: {wandb_dir} (upload it with: wandb sync {wandb_dir})",
    ]
    assert lines[done + 5].startswith("next: ") and lines[done + 5:] == lines[-1:]
    commands = [shlex.split(c) for c in lines[-1].removeprefix("next: ").split("   |   ")]
    assert [c[:2] for c in commands] == [["python", "sample.py"], ["python", "evaluate.py"], ["python", "train.py"]]
    assert commands[2][2:] == ["--resume", "--out", str(out), "--steps", "12"]
    # sample.py and evaluate.py as printed (on the CPU, briefly): they read this run.
    assert sample.main([*commands[0][2:], "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "checkpoint-6.safetensors (step 6)" in capsys.readouterr().err
    assert evaluate.main([*commands[1][2:], "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-6)


@pytest.mark.slow  # train.py in a subprocess
def test_progress_lines_when_piped(tmp_path, text_file):
    """train.py with its output piped: the first line in words, the description, a progress line at once after
    step 1 (no warm-up on the CPU) and at each log step, with the time left; no carriage return; the summary."""
    out = tmp_path / "piped"
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--data", str(text_file), "--out", str(out),
                           "--steps", "4", "--log-every", "2", "--eval-every", "0", "--keep-checkpoints", "0",
                           "--wandb", "disabled"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"\r" not in proc.stdout and b"\r" not in proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[0] == (f"training 32 wide, 2 layers on {text_file} for 4 steps on cpu: fp32 throughout; eager "
                        f"(--compile compiles, which pays on GPUs); no CUDA graph (CUDA graphs need a GPU); "
                        f"writing {out}")
    assert lines[1].startswith("model: ") and lines[2].startswith("data: ") and lines[3].startswith("steps 0 to 4")
    progress = [line for line in lines if line.startswith("train ")]
    assert [line.split(" steps")[0] for line in progress] == ["train 1/4", "train 2/4", "train 4/4"]
    for line in progress[:-1]:
        assert re.match(r"train \d/4 steps, [\d.]+ s left: loss \d", line), line
    assert progress[-1].startswith("train 4/4 steps: loss ")  # done: nothing left
    assert lines.index(progress[0]) == 4  # step 1 reports before any other line
    assert re.fullmatch(r"done: step 4 of 4 in \d+\.\d s", lines[lines.index(progress[-1]) + 1])
    assert "checkpoint: none written" in lines and not any(line.startswith("next: ") for line in lines)
    assert not list(out.glob("checkpoint*"))  # --keep-checkpoints 0 writes none


@pytest.mark.slow  # train.py runs
def test_the_default_warm_up_is_at_most_a_tenth_of_the_run(tmp_path, text_file):
    flags = [f for f in TINY if f not in ("--warmup-steps", "5")]
    out = tmp_path / "run"
    assert train.main([*flags, "--data", str(text_file), "--out", str(out), "--wandb", "disabled", "--steps", "20",
                       "--log-every", "1", "--eval-every", "0", "--keep-checkpoints", "0"]) == 0
    lrs = [r["lr"] for r in read_rows(out)]
    peak = lrs.index(max(lrs)) + 1  # the step at which the learning rate reaches its peak
    assert max(lrs) == pytest.approx(3e-3) and peak <= 20 // 10
    assert lrs[:peak] == sorted(lrs[:peak]) and lrs[peak - 1:] == sorted(lrs[peak - 1:], reverse=True)
    assert json.loads((out / "config.json").read_text())["optim"]["warmup_steps"] == 2
    for steps, warmup in ((5, 0), (250, 25), (5000, 100)):  # min(100, steps // 10)
        config, explicit = cli.parse([*flags, "--data", str(text_file), "--steps", str(steps)])
        assert resolve(config, explicit).config.optim.warmup_steps == warmup


@pytest.mark.slow  # two runs of train.py
def test_config_json_reproduces_the_run(tmp_path, text_file, capsys):
    """train.py writes <out>/config.json, resolved; `--config <that file> --out Y` runs the same configuration,
    with the same losses."""
    code, first, out = run(tmp_path, text_file, "--steps", "3", "--log-every", "1", "--seed", "3", "--grad-clip",
                           "0.5", "--eval-every", "0", "--window", "8", "--window-pattern", "LG")
    assert code == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["window"] == 8 and saved["model"]["vocab_size"] == 256
    assert saved["execution"]["dtype"] == "fp32" and saved["execution"]["device"] == "cpu"
    assert saved["optim"]["grad_clip"] == 0.5 and saved["run"]["seed"] == 3 and saved["run"]["out"] == str(out)
    config, _ = cli.parse(["--config", str(out / "config.json"), "--out", str(tmp_path / "again")])
    assert config.replace(run={"out": str(out)}).to_dict() == saved

    again = tmp_path / "again"
    assert train.main(["--config", str(out / "config.json"), "--out", str(again)]) == 0
    assert json.loads((again / "config.json").read_text()) == {**saved, "run": {**saved["run"], "out": str(again)}}
    assert read_rows(again) == [{**r, "step_ms": a["step_ms"], "tokens_per_s": a["tokens_per_s"]}
                                for r, a in zip(first, read_rows(again), strict=True)]


def test_profile_records_the_steps_after_the_warm_up_and_a_resumed_run_does_not_again(tmp_path, text_file, capsys):
    prof = tmp_path / "prof"
    code, rows, out = run(tmp_path, text_file, "--steps", "14", "--eval-every", "0", "--profile", str(prof),
                          "--profile-steps", "2")
    assert code == 0 and [r["step"] for r in rows][-1] == 14
    # No warm-up on the CPU: step 10 warms the profiler up, 11 and 12 are recorded.
    assert f"profiled steps 11-12: {prof / 'trace-rank0.json'}, kernels-rank0.md" in capsys.readouterr().out
    events = json.loads((prof / "trace-rank0.json").read_text())["traceEvents"]
    assert sum(e["name"].startswith("ProfilerStep#") for e in events) == 2
    assert "steps 11-12, rank 0" in (prof / "kernels-rank0.md").read_text()
    assert json.loads((out / "config.json").read_text())["run"]["profile"] == str(prof)

    shutil.rmtree(prof)
    assert train.main(["--resume", "--out", str(out), "--steps", "30"]) == 0
    assert "profiled" not in capsys.readouterr().out and not prof.exists()
    assert json.loads((out / "config.json").read_text())["run"]["profile"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU kernels need a GPU")
@pytest.mark.parametrize("graph", ["--cuda-graph", "--no-cuda-graph"])
def test_profile_on_the_gpu_tables_the_kernels_and_splits_the_gpu_time(tmp_path, text_file, capsys, graph):
    prof = tmp_path / "prof"
    code, _, _ = run(tmp_path, text_file, "--device", "cuda", "--dtype", "bf16", "--no-compile", graph, "--steps", "20",
                     "--eval-every", "0", "--keep-checkpoints", "0", "--profile", str(prof), "--profile-steps", "2")
    assert code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "profiled steps" in line)
    split = re.search(r"GPU time per step ([\d.]+) ms: computing ([\d.]+), communicating ([\d.]+) \(([\d.]+) of it "
                      r"with nothing computing\), idle ([\d.]+)", line)
    span, computing, communicating, exposed, idle = map(float, split.groups())
    assert 0 < computing <= span and communicating == exposed == 0  # one process: no collectives
    # Twenty steps' worth of the window's time: the recorded steps only, each one step's length at most.
    step_ms = [r["step_ms"] for r in read_rows(tmp_path / "run")]
    assert span < 5 * max(step_ms)
    table = (prof / "kernels-rank0.md").read_text()
    assert "GPU kernels by total GPU time" in table and table.count("\n| `") >= 5  # the step's kernels, by name
    events = json.loads((prof / "trace-rank0.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events) and not any(e.get("cat") == "cpu_op" for e in events)


@pytest.mark.slow  # train.py runs and resumes
def test_resume_needs_no_model_flags_and_refuses_one_that_changes_the_model(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert train.main(["--size", "tiny", "--context-length", "128", "--batch-size", "8", "--steps", "1", "--out",
                       str(out), "--data", str(text_file), "--eval-batches", "1", "--wandb", "disabled"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"training tiny (256 wide, 4 layers) on {text_file} for 1 steps on cpu: fp32 throughout; eager (--compile "
        f"compiles, which pays on GPUs); no CUDA graph (CUDA graphs need a GPU); writing {out}")
    assert train.main(["--resume", "--out", str(out), "--steps", "2"]) == 0  # the run's config.json, steps aside
    output = capsys.readouterr().out
    assert output.startswith(f"training tiny (256 wide, 4 layers) on {text_file} for 2 steps on cpu: ")
    assert f"resuming from {out / 'checkpoint-1.safetensors'} (step 1)" in output
    assert "model: 4.3M parameters, d_model 256, 4 layers, 4 heads, context 128" in output
    assert [r["step"] for r in read_rows(out)] == [1, 2]
    first, second = (checkpoint.load(out / f"checkpoint-{s}.safetensors")["config"] for s in (1, 2))
    assert second == {**first, "run": {**first["run"], "steps": 2, "resume": True}}

    before = snapshot(out)
    assert exit_status(["--resume", "--out", str(out), "--steps", "3", "--d-model", "512"]) == 2
    assert capsys.readouterr().err == (
        f"error: --d-model 512 differs from the run in {out}, which has 256: a resumed run keeps its model (drop the "
        "flag, or start a new run with another --out)\n")
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--data", "/no/such/file.txt"], 1, "--data path does not exist: /no/such/file.txt"),
        (["--d-model", "30", "--n-heads", "4"], 2, r"--d-model \(30\) must be divisible by --n-heads \(4\)"),
        (["--n-kv-heads", "3"], 2, r"--n-kv-heads must divide --n-heads \(2\), got 3"),
        (["--window-pattern", "LLLG"], 2, "--window-pattern LLLG needs --window"),
        (["--window", "0"], 2, "--window must be >= 1, got 0"),
        (["--d-model", "40", "--dtype", "bf16", "--fp8", "rowwise"], 2,
         "--fp8 rowwise needs a --d-model that is a multiple of 16"),
        (["--attn", "fast"], 2, "unknown --attn 'fast'; valid: naive"),
        (["--size", "huge"], 2, "argument --size: invalid choice: 'huge'"),
        (["--steps", "0"], 2, "--steps must be >= 1"),
        (["--dtype", "fp16"], 2, "fp16 needs a CUDA device"),
        (["--cuda-graph"], 2, "--cuda-graph: CUDA graphs need a GPU"),
        (["--grad-accum-steps", "0"], 2, "--grad-accum-steps must be >= 1, got 0"),
        (["--optimizer", "muon", "--parallel", "fsdp"], 2, "--parallel fsdp shards them"),
        (["--optimizer", "fp8"], 2, "unknown --optimizer 'fp8'; valid: adamw, adamw-bf16"),
        (["--grad-accum-steps", "3"], 2, r"--grad-accum-steps 3 must divide the sequences per rank and step \(4\)"),
        (["--profile-steps", "0"], 2, "--profile-steps must be >= 1, got 0"),
        (["--profile", __file__], 2, f"--profile {__file__}: exists and is not a directory"),
    ],
)
def test_bad_input_stops_with_a_message(tmp_path, text_file, capsys, argv, code, message):
    base = [*TINY, "--out", str(tmp_path / "bad"), "--wandb", "disabled", "--steps", "2"]
    if "--data" not in argv:
        base += ["--data", str(text_file)]
    assert exit_status(base + argv) == code
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert re.search(message, line) and "usage" not in err, err


def test_a_profile_directory_that_cannot_be_written_is_refused_before_the_run(tmp_path, text_file, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root may write anywhere: stand in for a read-only disk
    out, prof = tmp_path / "run", tmp_path / "ro" / "prof"
    assert exit_status([*TINY, "--data", str(text_file), "--out", str(out), "--profile", str(prof)]) == 2
    assert capsys.readouterr().err == f"error: --profile {prof}: {tmp_path} is not writable\n"
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--no-checkpoint"], ["--overlap-optimizer"], ["--weight-grads", "fp32"],
                                  ["--residual", "fp32"], ["--fused-rope", "on"], ["--fused-gate-up", "on"],
                                  ["--compile-scope", "model"], ["--optim-state-dtype", "bf16"], ["--no-such-flag"],
                                  ["--steps", "many"]])
def test_a_bad_flag_is_one_line_without_usage(tmp_path, text_file, capsys, argv):
    """Retired and unknown flags, and a value of the wrong type: one line naming it, exit status 2, nothing run."""
    out = tmp_path / "run"
    assert exit_status([*TINY, "--data", str(text_file), "--out", str(out), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    assert argv[0] in captured.err and argv[-1] in captured.err
    assert not out.exists()


def test_help_lists_the_main_flags_and_the_others_are_accepted(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    listed = set(re.findall(r"^  (--[a-z0-9-]+)", capsys.readouterr().out, re.MULTILINE))
    assert {"--size", "--d-model", "--attn", "--dtype", "--optimizer", "--lr", "--data", "--batch-size", "--steps",
            "--out", "--resume", "--overwrite", "--config"} <= listed
    hidden = {"--log-every", "--eval-batches", "--ckpt-every", "--keep-checkpoints", "--wandb", "--min-lr",
              "--grad-accum-steps", "--window-pattern"}
    assert not hidden & listed
    config, explicit = cli.parse(["--log-every", "3", "--eval-batches", "2", "--ckpt-every", "4", "--keep-checkpoints",
                                  "0", "--wandb", "disabled", "--min-lr", "1e-5", "--grad-accum-steps", "2",
                                  "--window-pattern", "LG"])
    assert (config.run.log_every, config.run.eval_batches, config.run.ckpt_every, config.run.keep_checkpoints,
            config.run.wandb, config.optim.min_lr, config.execution.grad_accum_steps,
            config.model.window_pattern) == (3, 2, 4, 0, "disabled", 1e-5, 2, "LG")
    assert {"log_every", "keep_checkpoints", "min_lr", "window_pattern"} <= explicit


@pytest.mark.slow  # train.py runs
def test_a_batch_the_micro_batches_do_not_divide_leaves_the_earlier_run_in_place(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    base = [*TINY, "--out", str(out), "--wandb", "disabled", "--steps", "1", "--data", str(text_file)]
    assert train.main(base) == 0
    before = sorted(p.name for p in out.iterdir())
    assert exit_status(base + ["--overwrite", "--grad-accum-steps", "3"]) == 2
    assert "--grad-accum-steps 3 must divide" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before and not list(tmp_path.glob("run.old-*"))


@pytest.mark.slow  # two runs of train.py
def test_micro_batches_train_and_evaluate_like_the_whole_batch(tmp_path, text_file):
    flags = ("--steps", "3", "--log-every", "1", "--eval-every", "3", "--grad-clip", "0")
    whole = run(tmp_path, text_file, *flags, name="whole")[1]
    micro = run(tmp_path, text_file, *flags, "--grad-accum-steps", "2", name="micro")[1]
    for a, b in zip(whole, micro, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                     rel=1e-4)
    assert micro[-1]["val_loss"] == pytest.approx(whole[-1]["val_loss"], abs=1e-5)


def test_corpus_shorter_than_a_window(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    assert train.main([*TINY, "--data", str(short), "--out", str(tmp_path / "o"), "--wandb", "disabled"]) == 1
    assert "too short for a training and a validation window of context length 32" in capsys.readouterr().err


@pytest.mark.slow  # train.py runs and resumes
def test_a_checkpoint_of_the_earlier_version_resumes_with_the_same_losses(tmp_path, text_file, capsys):
    """A run of the earlier version: no config.json, its checkpoint keyed "model_config" (with the switches since
    retired, and the attention backend) and "args", its optimizer state keyed by index. It is refused for another
    model, and otherwise resumes where a straight run would be."""
    args = ("--steps", "4", "--log-every", "1", "--eval-every", "0", "--ckpt-every", "2")
    code, straight, out = run(tmp_path, text_file, *args, name="straight")
    assert code == 0
    old = tmp_path / "old"
    old.mkdir()
    state = checkpoint.load(out / "checkpoint-2.safetensors")
    path = write_legacy(state, old, args={"data": str(text_file), "batch_size": 4, "steps": 4, "dtype": "fp32"})
    assert path == old / "checkpoint-2.pt"
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in straight[:2]))

    resume = [*TINY, "--data", str(text_file), "--out", str(old), "--wandb", "disabled", "--resume", *args]
    before = snapshot(old)
    assert train.main(resume) == 1  # pickled: read only when trusted
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: no checkpoint in {old} loads: checkpoint-2.pt (written by an earlier version with pickle, which can "
        "run code when loaded; pass --allow-pickle if you trust this file)")
    assert snapshot(old) == before
    resume.append("--allow-pickle")
    assert train.main([*resume, "--d-model", "64"]) == 1
    assert (f"checkpoint {old / 'checkpoint-2.pt'} was written for another model: --d-model 32 (asked 64)"
            in capsys.readouterr().err)
    assert snapshot(old) == before
    assert train.main(resume) == 0
    assert [r["loss"] for r in read_rows(old)] == [r["loss"] for r in straight]
    assert checkpoint.load(old / "checkpoint-4.safetensors")["config"]["model"] == state["config"]["model"]


@pytest.mark.slow  # torch.compile
def test_compile_trains_like_eager(tmp_path, text_file, monkeypatch):
    """train.py's --compile plumbing; aot_eager for speed (Inductor's numerics: tests/training/test_compilation.py)."""
    from torch._dynamo.backends.debugging import aot_eager

    args = ("--steps", "3", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--keep-checkpoints", "0")
    code, eager, _ = run(tmp_path, text_file, *args, name="eager")
    assert code == 0
    real_compile, calls, traced = torch.compile, [], []

    def backend(gm, example_inputs):
        traced.append(gm)
        return aot_eager(gm, example_inputs)

    def compile_aot_eager(fn, **kwargs):
        calls.append(fn)
        return real_compile(fn, **{**kwargs, "backend": backend})

    monkeypatch.setattr(torch, "compile", compile_aot_eager)
    torch._dynamo.reset()
    code, rows, _ = run(tmp_path, text_file, *args, "--compile", name="compiled")
    torch._dynamo.reset()
    assert code == 0
    assert len(calls) == 2 + 1  # each of the 2 blocks, and the loss
    # One graph for all blocks and one for the loss, in training and in evaluation.
    assert len(traced) == 2 * 2
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in eager], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows[-1]["val_loss"], eager[-1]["val_loss"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_trains_like_the_plain_step_and_resumes(tmp_path, text_file):
    """--cuda-graph: 2 eager steps, a capture, replays; the same losses and gradient norms as the plain step, with
    the learning-rate schedule applied (warm-up and decay change it every step), and a resume from its checkpoint."""
    gpu = ("--device", "cuda", "--steps", "12", "--log-every", "1", "--eval-every", "6", "--ckpt-every", "6",
           "--dtype", "fp32", "--no-compile")
    code, plain, _ = run(tmp_path, text_file, *gpu, "--no-cuda-graph", name="plain")
    assert code == 0
    code, graphed, out = run(tmp_path, text_file, *gpu, "--cuda-graph", name="graphed")
    assert code == 0
    assert [r["step"] for r in graphed] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close([r[key] for r in graphed], [r[key] for r in plain], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(graphed[-1]["val_loss"], plain[-1]["val_loss"], rtol=1e-4, atol=1e-5)
    code, _, _ = run(tmp_path, text_file, *gpu[:2], "--steps", "14", "--log-every", "1", "--eval-every", "0",
                     "--dtype", "fp32", "--no-compile", "--cuda-graph", "--resume", name="graphed")
    assert code == 0


@pytest.mark.slow  # train.py runs and resumes
def test_without_clipping_the_optimizer_steps_in_the_backward_and_checkpoints_interchange(tmp_path, text_file,
                                                                                           capsys):
    """--grad-clip 0 steps each parameter during the backward: the same losses and gradient norms as one optimizer
    step after it (a clip threshold no norm reaches leaves the gradients as they are), and either run's checkpoint
    resumes the other way."""
    args = ("--steps", "6", "--log-every", "1", "--eval-every", "0")
    code, plain, plain_out = run(tmp_path, text_file, *args, "--grad-clip", "1e9", name="plain")
    assert code == 0
    assert "stepped during the backward" not in capsys.readouterr().out
    code, rows, out = run(tmp_path, text_file, *args, "--grad-clip", "0", name="overlap")
    assert code == 0
    assert "adamw stepped during the backward (no clipping)" in capsys.readouterr().out.splitlines()[0]
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in plain], rtol=1e-6, atol=0)
    # Each run's checkpoint carries on the other way; both continue alike.
    resume = [*TINY, "--data", str(text_file), "--wandb", "disabled", "--resume", "--steps", "8", "--log-every", "1"]
    assert train.main([*resume, "--out", str(out), "--grad-clip", "1e9"]) == 0
    assert train.main([*resume, "--out", str(plain_out), "--grad-clip", "0"]) == 0
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in read_rows(out)], [r[key] for r in read_rows(plain_out)],
                                   rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")
def test_stepping_in_the_backward_on_the_gpu_graphed_trains_like_the_plain_step(tmp_path, text_file):
    gpu = ("--device", "cuda", "--steps", "8", "--log-every", "1", "--eval-every", "0", "--dtype", "bf16",
           "--keep-checkpoints", "0", "--no-compile")
    code, plain, _ = run(tmp_path, text_file, *gpu, "--grad-clip", "1e9", "--no-cuda-graph", name="plain")
    assert code == 0
    code, rows, _ = run(tmp_path, text_file, *gpu, "--grad-clip", "0", "--cuda-graph", name="overlap")
    assert code == 0
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in plain], rtol=1e-4, atol=1e-5)


def test_a_run_with_the_recipe_options_names_them_and_saves_them(tmp_path, text_file, capsys):
    """--qk-norm, --mlp relu2 and --zero-init-residual: said in the first lines, kept in config.json, and a resume
    builds the same model (the ReLU² MLP has no w3 in its checkpoint)."""
    flags = ["--qk-norm", "--mlp", "relu2", "--zero-init-residual", "--steps", "2", "--eval-every", "0"]
    code, _, out = run(tmp_path, text_file, *flags)
    assert code == 0
    assert "QK-norm, relu2 MLP, zero-initialised residual projections" in capsys.readouterr().out
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["qk_norm"], model["mlp"], model["zero_init_residual"]) == (True, "relu2", True)
    assert train.main(["--resume", "--out", str(out), "--steps", "3", "--data", str(text_file),
                       "--wandb", "disabled"]) == 0


@pytest.fixture
def restores_determinism():
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_deterministic_turns_on_torchs_switch_and_is_recorded(tmp_path, text_file, capsys, restores_determinism):
    """--deterministic: torch.use_deterministic_algorithms(True) for the run, said and kept in config.json."""
    torch.use_deterministic_algorithms(False)
    code, rows, out = run(tmp_path, text_file, "--steps", "2", "--eval-every", "0", "--deterministic")
    assert code == 0 and len(rows) > 0
    assert torch.are_deterministic_algorithms_enabled()
    assert "deterministic algorithms: bitwise-reproducible steps" in capsys.readouterr().out.splitlines()[0]
    assert json.loads((out / "config.json").read_text())["execution"]["deterministic"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_deterministic_runs_on_the_gpu_repeat_bitwise(tmp_path, text_file, restores_determinism):
    """Two --deterministic runs with flash, graphed (the Hopper backward at every size on an sm_90 GPU), log the same
    losses and gradient norms to the last bit: no operator of the step refused."""
    gpu = ("--device", "cuda", "--steps", "8", "--log-every", "1", "--eval-every", "0", "--dtype", "bf16",
           "--keep-checkpoints", "0", "--no-compile", "--attn", "flash", "--deterministic")
    runs = [run(tmp_path, text_file, *gpu, name=f"run{i}")[1] for i in range(2)]
    assert len(runs[0]) == 8
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in runs[0]] == [r[key] for r in runs[1]], key
