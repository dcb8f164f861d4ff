"""flash's split-KV decode: the Triton kernels (in the interpreter without a GPU) and their PyTorch spec against
a float64 masked softmax, over cache lengths and split counts that do and do not divide them."""

from __future__ import annotations

import math

import pytest
import torch

from attention.flash.decode.host import chunk_bounds, decode_reference_f64, decode_split_torch, decode_triton
from tests.attention.conftest import DEVICE, randn

# (cache length, split counts): one that divides the length and one that does not (empty chunks included).
CASES = [(1, (1, 3)), (17, (1, 2)), (1000, (4, 3)), (4097, (17, 8))]


def inputs(length: int, n_new: int = 1, dtype=torch.float32, heads: int = 2, d: int = 32):
    """A cache of length + 5 positions (the tail never read), two sequences: one full, one at a third."""
    q = randn(2, heads, n_new, d, dtype=dtype, seed=1)
    k = randn(2, heads, length + 5, d, dtype=dtype, seed=2)
    v = randn(2, heads, length + 5, d, dtype=dtype, seed=3)
    # Poison the unread tail: a read past cache_len would show.
    k[..., length:, :] = float("nan")
    v[..., length:, :] = float("nan")
    cache_len = torch.tensor([length, max(n_new, length // 3)], device=DEVICE)
    return q, k, v, cache_len


# The longest cache takes seconds in the interpreter: it runs with -m slow.
@pytest.mark.parametrize("length,splits", [pytest.param(n, s, id=f"len{n}",
                                                        marks=[pytest.mark.slow] if n > 1000 else [])
                                           for n, s in CASES])
def test_kernel_matches_float64(length, splits):
    q, k, v, cache_len = inputs(length)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = decode_reference_f64(q, k.nan_to_num(), v.nan_to_num(), cache_len, scale)
    for num_splits in splits:
        o = decode_triton(q, k, v, cache_len, scale, num_splits=num_splits)
        assert o.shape == q.shape and o.dtype == q.dtype
        torch.testing.assert_close(o.double(), ref, atol=2e-6, rtol=1e-5, msg=f"{num_splits} splits")


@pytest.mark.parametrize("length,splits", CASES, ids=[f"len{n}" for n, _ in CASES])
def test_pytorch_spec_matches_float64(length, splits):
    q, k, v, cache_len = (t.double() if t.is_floating_point() else t for t in inputs(length))
    ref = decode_reference_f64(q, k.nan_to_num(), v.nan_to_num(), cache_len, 0.2)
    for num_splits in splits:
        # The spec computes every score (0 * NaN would spread), so it gets the tail zeroed.
        o = decode_split_torch(q, k.nan_to_num(), v.nan_to_num(), cache_len, 0.2, num_splits=num_splits)
        torch.testing.assert_close(o, ref, atol=1e-12, rtol=1e-12)


def test_kernel_fp16_and_several_new_queries():
    q, k, v, cache_len = inputs(300, n_new=3, dtype=torch.float16)
    ref = decode_reference_f64(q, k.nan_to_num(), v.nan_to_num(), cache_len, 0.125)
    o = decode_triton(q, k, v, cache_len, 0.125, num_splits=5)
    assert o.dtype == torch.float16
    torch.testing.assert_close(o.double(), ref, atol=2e-3, rtol=2e-3)


def test_kernel_reads_strided_queries_and_an_int_length():
    """q as the model passes it: a (batch, heads, n_new, d) view of (batch, n_new, heads, d) storage."""
    q_bshd = randn(2, 1, 4, 32, seed=4)
    q = q_bshd.transpose(1, 2)
    _, k, v, _ = inputs(100, heads=4)
    ref = decode_reference_f64(q, k.nan_to_num(), v.nan_to_num(), 100, 0.3)
    torch.testing.assert_close(decode_triton(q, k, v, 100, 0.3, num_splits=3).double(), ref, atol=2e-6, rtol=1e-5)


def test_chunks_are_whole_tiles_and_cover_the_visible_keys():
    q = torch.zeros(1, 1, 1, 8)
    lo, hi = chunk_bounds(torch.tensor([1000]), q, 3)
    assert lo.flatten().tolist() == [0, 384, 768] and hi.flatten().tolist() == [384, 768, 1000]
    lo, hi = chunk_bounds(torch.tensor([1]), q, 3)  # chunks past the end are empty
    assert (hi - lo).clamp(min=0).flatten().tolist() == [1, 0, 0]
