"""`flash-torch` (attention/flash/reference.py) against float64, and flash vs flash-torch vs naive agreement.
`flash_case` is parametrized by conftest.FLASH_CASES."""

from __future__ import annotations

import math

import pytest
import torch

from attention import UnsupportedInputError, get_attention, list_attention
from attention.flash import FlashAttentionTorch, FlashAttentionTriton
from attention.flash import reference
from tests.attention.conftest import DEVICE, dtype_id, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # plain PyTorch: bf16 is right on the CPU too


def run_flash_torch(q, k, v, causal, scale):
    return FlashAttentionTorch.apply(q, k, v, causal, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_float64_reference(flash_case, dtype, check_flash):
    check_flash(run_flash_torch, flash_case, dtype, DEVICE)


def test_float64_inputs_match_to_float64_precision(check_flash, flash_case):
    check_flash(run_flash_torch, flash_case, torch.float64, DEVICE)


@pytest.mark.parametrize("tiles", [(16, 16), (32, 8), (8, 32)], ids=["16x16", "32x8", "8x32"])
def test_any_tile_sizes_give_the_same_answer(monkeypatch, tiles, flash_reference, rel_error):
    """Tiles of unequal size put the causal band at every offset inside a tile."""
    monkeypatch.setattr(reference, "Q_TILE", tiles[0])
    monkeypatch.setattr(reference, "K_TILE", tiles[1])
    q, k, v = (randn(2, 45, 24, seed=s, dtype=torch.float64).requires_grad_() for s in range(3))
    for causal in (True, False):
        o = FlashAttentionTorch.apply(q, k, v, causal)
        do = randn(*o.shape, seed=3, dtype=torch.float64)
        got = (o, *torch.autograd.grad(o, (q, k, v), do))
        want = [r for i, r in enumerate(flash_reference(q, k, v, causal, 1 / math.sqrt(24), do)) if i != 1]
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert rel_error(a, b) <= 1e-10, (name, causal)


def test_backward_is_bitwise_deterministic():
    q, k, v = (randn(1, 2, 100, 48, seed=s).requires_grad_() for s in range(3))
    o = FlashAttentionTorch.apply(q, k, v, True)
    do = randn(*o.shape, seed=3)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("causal, n_q, n_k", [(True, 100, 100), (False, 100, 37)], ids=["causal", "q100-k37"])
def test_every_output_element_is_written(check_every_element_written, causal, n_q, n_k):
    """o, L, dk and dv are written tile by tile (dq is a zero-started accumulator)."""
    check_every_element_written(FlashAttentionTorch, causal, n_q, n_k)


def test_saved_tensors_are_linear_in_seq(check_saved_tensors_are_linear_in_seq):
    check_saved_tensors_are_linear_in_seq(FlashAttentionTorch)


def test_bad_input_is_refused():
    q = randn(1, 1, 8, 16)
    with pytest.raises(UnsupportedInputError, match="k and v must have the same shape"):
        FlashAttentionTorch.apply(q, q, randn(1, 1, 9, 16), False)
    with pytest.raises(UnsupportedInputError, match="causal attention needs equal query and key lengths"):
        FlashAttentionTorch.apply(q, randn(1, 1, 9, 16), randn(1, 1, 9, 16), True)


def test_registry_lists_and_runs_flash_torch():
    rows = {r.name: r for r in list_attention()}
    assert rows["flash-torch"].available
    q, k, v = (randn(2, 1, 40, 32, seed=s) for s in range(3))
    assert torch.equal(get_attention("flash-torch")(q, k, v, causal=True), FlashAttentionTorch.apply(q, k, v, True))


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["causal", "full"])
def test_flash_flash_torch_and_naive_agree(causal, rel_error):
    """The kernel, its PyTorch specification and the reference backend give one answer (fp32)."""
    from attention.naive import naive_attention

    q = randn(1, 2, 100, 48, seed=0).requires_grad_()
    k, v = (randn(1, 2, 100 if causal else 70, 48, seed=s).requires_grad_() for s in (1, 2))
    do = randn(1, 2, 100, 48, seed=3)
    results, lse = {}, {}
    for name, fn in (
        ("flash", lambda: FlashAttentionTriton.apply(q, k, v, causal)),
        ("flash-torch", lambda: FlashAttentionTorch.apply(q, k, v, causal)),
        ("naive", lambda: naive_attention(q, k, v, causal, 1 / math.sqrt(48))),
    ):
        o = fn()
        if name != "naive":
            (lse[name],) = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
        results[name] = (o, *torch.autograd.grad(o, (q, k, v), do))
    for other in ("flash", "flash-torch"):
        for part, a, b in zip(("o", "dq", "dk", "dv"), results[other], results["naive"]):
            assert rel_error(a, b) <= 1e-4, (other, part)
    assert rel_error(lse["flash"], lse["flash-torch"]) <= 1e-5
