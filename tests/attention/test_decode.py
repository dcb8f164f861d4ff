"""The registry's decode path: `get_attention(name).decode(q, k_cache, v_cache, cache_len)` per backend, and
why_not_decode for the backends and inputs without one."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attention import UnsupportedInputError, get_attention, why_not_decode
from attention.flash.decode.host import decode_reference_f64
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
    (lambda q, k, v, n: (q, k, v, n > 0), "integer tensor"),
    (lambda q, k, v, n: (q, k, v, True), "cache_len must be an integer or an integer tensor, got True"),
    (lambda q, k, v, n: (q, k, v, 37.5), "cache_len must be an integer or an integer tensor, got 37.5"),
    (lambda q, k, v, n: (q[..., :8], k, v, n), "d_head"),
])
def test_bad_inputs_are_named(bad, message):
    q, k, v, cache_len = bad(*inputs())
    with pytest.raises(UnsupportedInputError, match=message):
        get_attention("naive").decode(q, k, v, cache_len)


VARIANT_DECODERS = ["naive", "sdpa", "flash-torch", "flash"]


@pytest.mark.parametrize("name", VARIANT_DECODERS)
@pytest.mark.parametrize("kv_heads, window, softcap", [
    (1, None, None), (2, None, None), (4, 1, None), (4, 33, None), (2, 300, None), (4, None, 5.0), (1, 20, 2.0)])
@pytest.mark.parametrize("n_new", [1, 3])
def test_decode_variants_match_float64(name, kv_heads, window, softcap, n_new):
    """GQA (a cache with 1 or 2 heads for 4 query heads), windows of 1, 33 and beyond the cache, softcap; ragged
    cache lengths (300 and 37 of 300), so a window cuts the long row and not the short one."""
    q = randn(2, 4, n_new, 16, seed=4)
    k, v = randn(2, kv_heads, 300, 16, seed=5), randn(2, kv_heads, 300, 16, seed=6)
    cache_len = torch.tensor([300, 37], device=DEVICE)
    variant = {"window": window, "softcap": softcap}
    if (reason := why_not_decode(name, q, k, v, cache_len, **variant)) is not None:
        assert name == "sdpa" and softcap is not None and "logit soft-capping" in reason
        pytest.skip(reason)
    o = get_attention(name).decode(q, k, v, cache_len, **variant)
    ref = decode_reference_f64(q, k, v, cache_len, 1 / math.sqrt(16), window, softcap)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)
    if window is not None and window < 37:  # the window changes the answer: not a vacuous mask
        plain = decode_reference_f64(q, k, v, cache_len, 1 / math.sqrt(16), None, softcap)
        assert (plain - ref).abs().max() > 1e-3


def test_decode_with_a_window_is_the_last_rows_of_windowed_attention():
    k, v = randn(1, 2, 50, 16, seed=7), randn(1, 2, 50, 16, seed=8)
    q = randn(1, 4, 50, 16, seed=9)
    full = get_attention("naive")(q, k, v, causal=True, window=7, softcap=3.0)
    o = get_attention("naive").decode(q[..., -2:, :], k, v, 50, window=7, softcap=3.0)
    torch.testing.assert_close(o, full[..., -2:, :], atol=1e-6, rtol=1e-6)


def test_decode_paths_say_which_variants_they_lack():
    q, k, v, cache_len = inputs()
    assert "its decode path does not run logit soft-capping" in why_not_decode("sdpa", q, k, v, cache_len,
                                                                               softcap=2.0)
    if DEVICE.type == "cuda":
        assert "does not run sliding windows" in why_not_decode("flex", q, k, v, cache_len, window=4)
    with pytest.raises(UnsupportedInputError, match="window must be an integer >= 1"):
        get_attention("naive").decode(q, k, v, cache_len, window=0)
    with pytest.raises(UnsupportedInputError, match="multiple of k's"):
        get_attention("naive").decode(randn(2, 3, 1, 16, seed=1), k, v, cache_len)


def test_decode_checks_run_once_per_call_signature(monkeypatch):
    """A decode signature the checks passed is not checked again (eager decode steps are bound by host time); a
    changed shape, variant, cache_len dtype or int value is checked anew, and a refused input every time."""
    from attention import registry

    checked = []

    def decode_check(q, k_cache, v_cache):
        checked.append(tuple(q.shape))
        return None

    monkeypatch.setitem(registry._BACKENDS, "naive", dataclasses.replace(
        registry._BACKENDS["naive"], decode_check=decode_check))
    decode = get_attention("naive").decode
    q, k, v, cache_len = inputs()
    for _ in range(3):
        decode(q, k, v, cache_len)
    assert len(checked) == 1
    changes = [dict(q=q[:1], k_cache=k[:1], v_cache=v[:1], cache_len=cache_len[:1]), dict(window=5), dict(softcap=2.0),
               dict(cache_len=cache_len.int()), dict(cache_len=40), dict(cache_len=41)]
    for n, change in enumerate(changes, start=2):
        args = {"q": q, "k_cache": k, "v_cache": v, "cache_len": cache_len, **change}
        for _ in range(2):
            decode(args["q"], args["k_cache"], args["v_cache"], args["cache_len"],
                   **{key: x for key, x in change.items() if key in ("window", "softcap")})
        assert len(checked) == n, change
    for _ in range(2):
        with pytest.raises(UnsupportedInputError, match=r"cache_len must be in 1\.\.128"):
            decode(q, k, v, 129)
