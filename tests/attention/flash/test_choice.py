"""Which of flash's kernels run an input, and why: attention.flash_kernels (attention.flash.choose_kernels).

The decision itself is tested on any machine by asking it for an sm_90 GPU (`capability=(9, 0)`);
on an sm_90 GPU the last test checks that what it says is what runs.
"""

from __future__ import annotations

import pytest
import torch

import attention
from attention import UnsupportedInputError, flash_kernels, get_attention, use_kernels
from attention.flash import KernelChoice
from attention.flash.hopper import host as hopper, inputs as hopper_inputs

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0) and hopper_inputs.gluon_problem() is None
requires_gluon = pytest.mark.skipif(hopper_inputs.gluon_problem() is not None, reason="needs triton's Gluon")
SM90 = (9, 0)


def qkv(b, h, n, d, dtype=torch.bfloat16, device="cuda" if CUDA else "cpu"):
    # On a GPU machine the tensors are CUDA ones: flash refuses CPU tensors there (no interpreter).
    return [torch.zeros(b, h, n, d, dtype=dtype, device=device) for _ in range(3)]


SHORT = (1, 2, 256, 64)  # 2^16 causal scores: host time decides
LONG = (1, 16, 8192, 64)  # 2^29 causal scores
SEQ_1000 = (1, 16, 1000, 64)  # not whole 128-row tiles


def test_choice_is_exported_next_to_why_not():
    assert attention.flash_kernels is attention.flash.choose_kernels
    choice = flash_kernels(*qkv(*SHORT, dtype=torch.float32), causal=True)
    assert isinstance(choice, KernelChoice)
    assert str(choice) == f"forward {choice.forward_reason}; backward {choice.backward_reason}"


@pytest.mark.skipif(CUDA, reason="the answer for CPU tensors")
@pytest.mark.parametrize("shape", [SHORT, LONG, SEQ_1000], ids=["short", "long", "seq1000"])
def test_cpu_tensors_run_the_triton_kernels(shape):
    choice = flash_kernels(*qkv(*shape, dtype=torch.float32), causal=True)
    assert (choice.forward, choice.backward) == ("triton", "triton")
    assert choice.forward_reason == "triton: the Hopper kernels need CUDA tensors"


@requires_gluon
@pytest.mark.parametrize("shape, dtype, kernel, reason", [
    (SHORT, torch.bfloat16, "triton",
     "triton: 2^16 scores are too few for the Hopper kernels: below 2^28 host time outweighs the faster kernels"),
    (LONG, torch.bfloat16, "hopper", "hopper: sm_90, bf16, d 64, 2^29 scores (at least 2^28)"),
    (SEQ_1000, torch.bfloat16, "triton",
     "triton: the Hopper kernels need a sequence that is a multiple of 128, got 1000"),
    (LONG, torch.float32, "triton", "triton: the Hopper kernels take float16 and bfloat16, not torch.float32"),
], ids=["short", "long", "seq1000", "fp32"])
def test_choice_for_an_sm90_gpu(shape, dtype, kernel, reason):
    choice = flash_kernels(*qkv(*shape, dtype=dtype), causal=True, capability=SM90)
    assert choice == KernelChoice(kernel, kernel, reason, reason)


def test_other_gpus_run_the_triton_kernels():
    choice = flash_kernels(*qkv(*LONG), causal=True, capability=(8, 0))
    assert choice.forward == choice.backward == "triton"
    assert choice.forward_reason == "triton: the Hopper kernels need an sm_90 (Hopper) GPU, this is sm_80"


@requires_gluon
def test_replayed_launches_take_the_hopper_kernels_on_short_problems():
    """Replayed from a CUDA graph only GPU time counts: the backward takes any size, the forward at d 128, and at
    d 64 from 2^27 scores."""
    d128 = flash_kernels(*qkv(1, 2, 256, 128), causal=True, capability=SM90, replayed=True)
    assert (d128.forward, d128.backward) == ("hopper", "hopper")
    assert d128.forward_reason == ("hopper: sm_90, bf16, d 128, 2^16 scores "
                                   "(any size, launches replayed from a CUDA graph)")
    d64 = flash_kernels(*qkv(*SHORT), causal=True, capability=SM90, replayed=True)
    assert (d64.forward, d64.backward) == ("triton", "hopper")
    assert "less GPU time" in d64.forward_reason and "replayed" in d64.forward_reason


@requires_gluon
def test_use_kernels_forces_triton():
    inputs = qkv(*LONG)
    with use_kernels("triton"):
        choice = flash_kernels(*inputs, causal=True, capability=SM90)
        with use_kernels("auto"):
            assert flash_kernels(*inputs, causal=True, capability=SM90).forward == "hopper"
    assert (choice.forward, choice.backward) == ("triton", "triton")
    assert choice.forward_reason == "triton: use_kernels('triton') is in effect"
    assert flash_kernels(*inputs, causal=True, capability=SM90).forward == "hopper"  # restored on exit
    assert flash_kernels(*inputs, causal=True, capability=SM90, kernels="triton").backward == "triton"
    with pytest.raises(ValueError, match="kernels must be one of auto, triton"):
        with use_kernels("hopper"):
            pass


def test_backward_choice_looks_at_the_upstream_gradient():
    q, k, v = qkv(*LONG)
    other_order = torch.zeros(1, 8192, 16, 64, dtype=torch.bfloat16, device=q.device).transpose(1, 2)
    if hopper_inputs.gluon_problem() is None:
        assert flash_kernels(q, k, v, causal=True, capability=SM90, do=other_order).backward == "hopper"
    transposed = torch.zeros(1, 16, 64, 8192, dtype=torch.bfloat16, device=q.device).transpose(-2, -1)
    choice = flash_kernels(q, k, v, causal=True, capability=SM90, do=transposed)
    assert choice.backward == "triton" and "need dO in (batch, heads, seq, d)" in choice.backward_reason


def test_input_flash_cannot_run_is_refused():
    with pytest.raises(UnsupportedInputError, match="head dim 8 is not supported"):
        flash_kernels(*qkv(1, 1, 16, 8), causal=True)


def test_the_launches_ask_the_choice(monkeypatch):
    """Eager flash asks the Hopper kernels' conditions through the choice, which use_kernels("triton") settles
    before asking."""
    asked = []
    real = hopper_inputs.forward_problem
    monkeypatch.setattr(hopper_inputs, "forward_problem", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    q, k, v = qkv(1, 2, 40, 32, dtype=torch.float32, device="cuda" if CUDA else "cpu")
    flash = get_attention("flash")
    flash(q, k, v, causal=True)
    assert asked == [1]
    with use_kernels("triton"):
        flash(q, k, v, causal=True)
    assert asked == [1]


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton's Gluon")
def test_long_causal_bf16_runs_the_hopper_kernels_on_sm90(monkeypatch):
    calls = []
    for name in ("forward", "backward"):
        real = getattr(hopper, name)
        monkeypatch.setattr(hopper, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    q, k, v = (torch.randn(*LONG, dtype=torch.bfloat16, device="cuda").requires_grad_() for _ in range(3))
    choice = flash_kernels(q, k, v, causal=True)
    assert choice == KernelChoice("hopper", "hopper", "hopper: sm_90, bf16, d 64, 2^29 scores (at least 2^28)",
                                  "hopper: sm_90, bf16, d 64, 2^29 scores (at least 2^28)")
    o = get_attention("flash")(q, k, v, causal=True)
    # A dense upstream gradient: .sum() would hand the backward a stride-0 dO, which the Hopper kernels refuse.
    o.backward(torch.randn_like(o))
    assert calls == ["forward", "backward"]
    short = flash_kernels(*qkv(*SHORT, device="cuda"), causal=True)
    assert short.forward == "triton" and "too few" in short.forward_reason
    assert flash_kernels(*qkv(*SEQ_1000, device="cuda"), causal=True).forward == "triton"
