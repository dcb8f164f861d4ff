"""End-to-end checks of train.py on the CPU with a tiny model."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import train
from tests.training.wandb_offline import history_and_summary
from training import checkpoint
from training.step import TrainingStep

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--device", "cpu", "--warmup-steps", "5", "--lr", "3e-3", "--min-lr", "3e-4"]


def run(tmp_path, text_file, *extra, name="run"):
    out = tmp_path / name
    code = train.main([*TINY, "--data", str(text_file), "--out", str(out), "--wandb", "disabled", *extra])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").exists() else []
    return code, rows, out


def test_loss_falls(tmp_path, text_file):
    code, rows, out = run(tmp_path, text_file, "--steps", "80", "--log-every", "5", "--eval-every", "40")
    assert code == 0
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5, (rows[0]["loss"], rows[-1]["loss"])
    assert rows[-1]["val_loss"] < 3.5
    for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu"):
        assert key in rows[-1]
    assert rows[-1]["mfu"] is None  # no made-up MFU on the CPU
    assert checkpoint.load(out / "checkpoint-80.pt")["step"] == 80


def test_ctrl_c_checkpoints_and_resume_reproduces_losses(tmp_path, text_file, monkeypatch):
    args = ("--steps", "16", "--log-every", "1", "--eval-every", "0", "--ckpt-every", "100")
    code, straight, _ = run(tmp_path, text_file, *args, name="straight")
    assert code == 0 and [r["step"] for r in straight] == list(range(1, 17))

    real_loss, calls = TrainingStep.loss, {"n": 0}

    def loss_then_interrupt(*a):
        calls["n"] += 1
        if calls["n"] == 7:  # Ctrl-C during step 7: the run finishes that step, checkpoints, stops
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*a)

    monkeypatch.setattr(TrainingStep, "loss", loss_then_interrupt)
    code, _, out = run(tmp_path, text_file, *args, name="resumed")
    assert code == 130
    assert checkpoint.load(out / "checkpoint-7.pt")["step"] == 7
    monkeypatch.setattr(TrainingStep, "loss", real_loss)

    code, resumed, _ = run(tmp_path, text_file, *args, "--resume", name="resumed")
    assert code == 0 and [r["step"] for r in resumed] == list(range(1, 17))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    real_loss, calls = TrainingStep.loss, {"n": 0}

    def nan_at_step_7(*a):
        calls["n"] += 1
        loss = real_loss(*a)
        return loss * float("nan") if calls["n"] >= 7 else loss

    monkeypatch.setattr(TrainingStep, "loss", nan_at_step_7)
    code, _, out = run(tmp_path, text_file, "--steps", "20", "--ckpt-every", "5", "--log-every", "4")
    assert code == 1
    assert "loss became nan at step 8" in capsys.readouterr().err
    assert checkpoint.load(out / "checkpoint-5.pt")["step"] == 5


def test_wandb_offline_run_holds_the_logged_keys(tmp_path, text_file):
    out = tmp_path / "wb"
    code = train.main([*TINY, "--data", str(text_file), "--out", str(out), "--steps", "6", "--log-every", "3",
                       "--wandb", "offline"])
    assert code == 0
    history, summary = history_and_summary(out / "wandb", min_rows=2)
    assert [h["_step"] for h in history] == [3, 6]
    for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s"):
        assert key in history[-1]
    assert "val_loss" in history[-1]
    assert summary["final_loss"] == history[-1]["loss"] and summary["steps"] == 6


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
        (["--size", "huge"], 2, "unknown --size 'huge'; valid: tiny, small"),
        (["--steps", "0"], 2, "--steps must be >= 1"),
        (["--dtype", "fp16"], 2, "fp16 needs a CUDA device"),
        (["--cuda-graph"], 2, "--cuda-graph needs a CUDA device, got --device cpu"),
        (["--overlap-optimizer"], 2, "before the global norm is known: add --grad-clip 0"),
        (["--overlap-optimizer", "--grad-clip", "0", "--parallel", "ddp"], 2, "--overlap-optimizer is for one process"),
        (["--grad-accum-steps", "0"], 2, "--grad-accum-steps must be >= 1, got 0"),
        (["--optim-state-dtype", "bf16", "--parallel", "fsdp"], 2, "--parallel fsdp shards them"),
        (["--optim-state-dtype", "fp8"], 2, "invalid choice: 'fp8'"),
        (["--grad-accum-steps", "2", "--overlap-optimizer", "--grad-clip", "0"], 2, "drop one"),
        (["--grad-accum-steps", "3"], 1, r"--grad-accum-steps 3 must divide the sequences per rank and step "
                                         r"\(--batch-size 4 over 1 rank: 4\)"),
    ],
)
def test_bad_input_stops_with_a_message(tmp_path, text_file, capsys, argv, code, message):
    base = [*TINY, "--out", str(tmp_path / "bad"), "--wandb", "disabled", "--steps", "2"]
    if "--data" not in argv:
        base += ["--data", str(text_file)]
    if code == 2:
        with pytest.raises(SystemExit) as e:
            train.main(base + argv)
        assert e.value.code == 2
    else:
        assert train.main(base + argv) == code
    import re

    assert re.search(message, capsys.readouterr().err)


def test_a_batch_the_micro_batches_do_not_divide_leaves_the_earlier_run_in_place(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    base = [*TINY, "--out", str(out), "--wandb", "disabled", "--steps", "1", "--data", str(text_file)]
    assert train.main(base) == 0
    before = sorted(p.name for p in out.iterdir())
    assert train.main(base + ["--overwrite", "--grad-accum-steps", "3"]) == 1
    assert "--grad-accum-steps 3 must divide" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before and not list(tmp_path.glob("run.old-*"))


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


def test_resume_with_another_model_is_refused(tmp_path, text_file, capsys):
    code, _, out = run(tmp_path, text_file, "--steps", "2")
    assert code == 0
    argv = [*TINY, "--d-model", "64", "--data", str(text_file), "--out", str(out), "--wandb", "disabled", "--resume"]
    assert train.main(argv) == 1
    assert "was written for another model" in capsys.readouterr().err


def test_resume_takes_an_older_checkpoint_and_another_weight_grad_rope_residual_and_gate_up_mode(tmp_path, text_file):
    # A checkpoint written before fp32_weight_grads, fused_rope, fp32_residual and fused_gate_up existed lacks them;
    # none changes a parameter, so a resume may also pick the other mode.
    code, _, out = run(tmp_path, text_file, "--steps", "2")
    assert code == 0
    state = checkpoint.load(out / "checkpoint-2.pt")
    fields = ("fp32_weight_grads", "fused_rope", "fp32_residual", "fused_gate_up")
    for field in fields:
        del state["model_config"][field]
    checkpoint.save_atomic(state, out / "checkpoint-2.pt")
    argv = [*TINY, "--data", str(text_file), "--out", str(out), "--wandb", "disabled", "--resume", "--steps", "3",
            "--weight-grads", "autocast", "--fused-rope", "off", "--residual", "autocast", "--fused-gate-up", "off"]
    assert train.main(argv) == 0
    resumed = checkpoint.load(out / "checkpoint-3.pt")
    assert resumed["step"] == 3
    assert {field: resumed["model_config"][field] for field in fields} == dict.fromkeys(fields, False)


@pytest.mark.parametrize("scope, compiled, graphs", [("blocks", 2 + 1, 2 * 2), ("model", 1, 1 * 2)],
                         ids=["blocks", "model"])
def test_compile_trains_like_eager(tmp_path, text_file, monkeypatch, scope, compiled, graphs):
    """train.py's --compile plumbing; aot_eager for speed (Inductor's numerics: tests/training/test_compilation.py)."""
    from torch._dynamo.backends.debugging import aot_eager

    args = ("--steps", "3", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-checkpoint")
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
    code, rows, _ = run(tmp_path, text_file, *args, "--compile", "--compile-scope", scope, name=scope)
    torch._dynamo.reset()
    assert code == 0
    assert len(calls) == compiled  # blocks: each of the 2 blocks, and the loss; model: the whole model
    # One graph for all blocks and one for the loss (with the loss inside the model), in training and in evaluation.
    assert len(traced) == graphs
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


def test_overlapped_optimizer_trains_like_the_plain_step_and_refuses_the_other_checkpoint(tmp_path, text_file, capsys):
    """--overlap-optimizer: the same losses and gradient norms as the plain AdamW without clipping, its own
    checkpoints resume, and a plain run's checkpoint is refused with a message."""
    args = ("--steps", "6", "--log-every", "1", "--eval-every", "0", "--grad-clip", "0")
    code, plain, plain_out = run(tmp_path, text_file, *args, name="plain")
    assert code == 0
    code, rows, out = run(tmp_path, text_file, *args, "--overlap-optimizer", name="overlap")
    assert code == 0
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in plain], rtol=1e-6, atol=0)
    resume = [*TINY, "--data", str(text_file), "--wandb", "disabled", "--resume", "--steps", "7", "--grad-clip", "0",
              "--overlap-optimizer"]
    assert train.main([*resume, "--out", str(out)]) == 0
    assert train.main([*resume, "--out", str(plain_out)]) == 1
    assert "drop or add --overlap-optimizer" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")
def test_overlapped_optimizer_on_the_gpu_graphed_trains_like_the_plain_step(tmp_path, text_file):
    gpu = ("--device", "cuda", "--steps", "8", "--log-every", "1", "--eval-every", "0", "--grad-clip", "0",
           "--dtype", "bf16", "--no-checkpoint", "--no-compile")
    code, plain, _ = run(tmp_path, text_file, *gpu, "--no-cuda-graph", name="plain")
    assert code == 0
    code, rows, _ = run(tmp_path, text_file, *gpu, "--overlap-optimizer", "--cuda-graph", name="overlap")
    assert code == 0
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in plain], rtol=1e-4, atol=1e-5)
