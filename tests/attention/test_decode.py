"""The registry's decode path: `get_attention(name).decode(q, k_cache, v_cache, cache_len)` per backend, and
why_not_decode for the backends and inputs without one."""

from __future__ import annotations

import math

import pytest
import torch

from attention import UnsupportedInputError, get_attention, why_not_decode
from attention.flash.decode import decode_reference_f64
from tests.attention.conftest import DEVICE, randn

DECODERS = ["naive", "sdpa", "flash-torch", "flash", "flex"]


def inputs(n_new: int = 1, length: int = 128, d: int = 16):
    q = randn(2, 2, n_new, d, seed=1)
    k = randn(2, 2, length, d, seed=2)
    v = randn(2, 2, length, d, seed=3)
    return q, k, v, torch.tensor([length, 37], device=DEVICE)


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("n_new", [1, 3])
def test_decode_matches_float64(name, n_new):
    q, k, v, cache_len = inputs(n_new)
    if (reason := why_not_decode(name, q, k, v, cache_len)) is not None:
        pytest.skip(reason)
    o = get_attention(name).decode(q, k, v, cache_len)
    ref = decode_reference_f64(q, k, v, cache_len, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)


def test_one_new_query_at_full_length_is_the_last_row_of_causal_attention():
    q, k, v, _ = inputs(length=40)
    full = get_attention("naive")(k, k, v, causal=True)
    o = get_attention("naive").decode(k[..., -1:, :], k, v, 40)
    torch.testing.assert_close(o, full[..., -1:, :], atol=1e-6, rtol=1e-6)


def test_backends_without_a_decode_path_say_so():
    q, k, v, cache_len = inputs()
    assert why_not_decode("sdpa-flash", q, k, v, cache_len) == "it has no decode path"
    with pytest.raises(UnsupportedInputError, match="'compiled' cannot decode this input: it has no decode path"):
        get_attention("compiled").decode(q, k, v, cache_len)


def test_flex_needs_cuda_and_whole_blocks():
    q, k, v, cache_len = inputs(length=100)
    reason = why_not_decode("flex", q, k, v, cache_len)
    assert ("multiple of 128" if DEVICE.type == "cuda" else "needs CUDA tensors") in reason


@pytest.mark.parametrize("bad,message", [
    (lambda q, k, v, n: (q, k, v[..., :5, :], n), "same shape"),
    (lambda q, k, v, n: (q, k, v, n.float()), "integer tensor"),
    (lambda q, k, v, n: (q, k, v, torch.tensor([1, 2, 3])), "leading dims"),
    (lambda q, k, v, n: (q, k, v, 0), r"cache_len must be in 1\.\.128"),
    (lambda q, k, v, n: (q[..., :8], k, v, n), "d_head"),
])
def test_bad_inputs_are_named(bad, message):
    q, k, v, cache_len = bad(*inputs())
    with pytest.raises(UnsupportedInputError, match=message):
        get_attention("naive").decode(q, k, v, cache_len)
