import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarking.attention_measure import BWD_RETAIN_GRAPH, measure_backend, run_mode
from benchmarking.attention_point import AttentionPoint, make_inputs
from benchmarking.attention_reference import reference


def point_and_inputs(causal=True, seq=32, d=16):
    p = AttentionPoint(1, 2, seq, d, "fp32", causal)
    inputs = make_inputs(p, "cpu", seed=5)
    return p, inputs, reference(inputs, causal)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_measure_train_backend(backend):
    p, inputs, ref = point_and_inputs()
    m = measure_backend(backend, p, inputs, ref, "cpu", iters=2, warmup=0)
    row = m.row
    assert row["status"] == "ok" and row["note"] is None
    assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["fwdbwd_ms"] > 0
    assert row["bwd_method"] == BWD_RETAIN_GRAPH
    assert row["fwd_tflops"] == pytest.approx(p.flop("fwd") / (row["fwd_ms"] * 1e-3) / 1e12)
    assert row["check"] == "ok" and row["rel_err"] < 1e-5
    assert row["saved_mib"] is None and row["saved_tensors_mib"] > 0  # CPU: no allocator figure
    assert m.saved and all(t.grad is None for t in inputs.leaves())
    assert "fwd_kernel" not in row  # only flash chooses between kernels


def flash_row_on_cpu() -> dict:
    p, inputs, ref = point_and_inputs(seq=40, d=16)
    return measure_backend("flash", p, inputs, ref, "cpu", iters=1, warmup=0).row


@pytest.mark.slow  # flash in the interpreter
def test_flash_rows_say_which_kernels_ran_and_why():
    # CPU tensors, so the Triton interpreter: chosen before the kernels load, which on a GPU machine (no
    # TRITON_INTERPRET in this process) means a fresh process with TRITON_INTERPRET=1.
    from attention.flash.triton import host as flash_triton

    if flash_triton.interpreting():
        row = flash_row_on_cpu()
    else:
        code = ("import json; from tests.benchmarking.test_attention_measure import flash_row_on_cpu; "
                "print(json.dumps(flash_row_on_cpu(), default=str))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).parents[2], env={**os.environ, "TRITON_INTERPRET": "1"})
        assert done.returncode == 0, done.stderr
        row = json.loads(done.stdout.splitlines()[-1])
    assert row["status"] == "ok" and (row["fwd_kernel"], row["bwd_kernel"]) == ("triton", "triton")
    assert row["kernel_reason"] == ("forward triton: the Hopper kernels need CUDA tensors; "
                                    "backward triton: the Hopper kernels need CUDA tensors")


def test_wrong_kernel_fails_the_check(monkeypatch):
    # A backend returning a slightly wrong answer must show up as FAIL, not as a fast row.
    import attention.naive as naive_module
    from attention import registry

    real = registry._BACKENDS["naive"]
    wrong = registry.Backend("naive", lambda q, k, v, causal, scale: naive_module.naive_attention(
        q, k, v, causal, scale * 1.05), real.description)
    monkeypatch.setitem(registry._BACKENDS, "naive", wrong)
    p, inputs, ref = point_and_inputs()
    row = measure_backend("naive", p, inputs, ref, "cpu", iters=1, warmup=0, time_passes=False).row
    assert row["check"] == "FAIL" and "fwd_ms" not in row  # time_passes=False: memory and errors only


def test_unsupported_input_gives_reason():
    p, inputs, ref = point_and_inputs(d=24)  # flex needs a power-of-two head dim
    m = measure_backend("flex", p, inputs, ref, "cpu", iters=1, warmup=0)
    assert m.row == {"status": "unsupported", "note": "FlexAttention's kernels need d_head a power of two >= 16, got 24"}


@pytest.mark.slow  # FlexAttention compiles
@pytest.mark.skipif(torch.cuda.is_available(), reason="flex has a backward on CUDA")
def test_forward_only_when_backward_is_missing():
    p, inputs, ref = point_and_inputs(seq=16)
    assert run_mode("flex", inputs, p)[0] == "forward"
    row = measure_backend("flex", p, inputs, ref, "cpu", iters=1, warmup=0).row
    assert row["status"] == "ok" and row["note"].startswith("forward only: FlexAttention has no backward")
    assert row["fwd_ms"] > 0 and row["bwd_ms"] is None and row["fwdbwd_ms"] is None
    assert row["err_out"] < 1e-5 and row["err_dq"] is None and row["check"] == "ok"
