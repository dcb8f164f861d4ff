"""Decode attention: a few new queries against a key/value cache whose first `cache_len` positions are filled.

    q        (..., heads, n_new, d_head)   the queries of the n_new newest tokens
    k_cache  (..., heads, max_len, d_head) keys of every position so far (the n_new new ones already written);
    v_cache  (..., heads, max_len, d_head) positions at or past cache_len hold anything and are never read
    cache_len                              filled positions per sequence: an int, or an integer tensor whose shape
                                           is a leading part of q.shape[:-2], typically (batch,)

Query j of the n_new sits at position cache_len - n_new + j and sees the keys at positions up to its own: every
earlier token, and causally the new ones. With n_new = 1 this is one sampling step. The variants of training
attention apply as there (attention/registry.py): the cache may have fewer heads than q (GQA: query head i reads
cache head i // (heads / kv heads)), `window=w` keeps the keys within w of the query's position (pos - w < j), and
`softcap=c` turns the scores s into c * tanh(s / c). A decode path declares which it runs. The values of cache_len are the
caller's promise (n_new <= cache_len <= max_len); they live on the device and are not checked, so that a decode
step never waits for the host and can be captured in a CUDA graph.

This module holds those semantics (`decode_naive`, the reference) and registers the decode paths of `naive`,
`sdpa` and `flex`; `flash` and `flash-torch` have a split-KV version of their own (attention/flash/decode/).
Callers reach them as `get_attention(name).decode(q, k_cache, v_cache, cache_len)`.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F

from attention.registry import register_decode

try:
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # torch < 2.5: the flex backend's environment check says so
    flex_attention = None

CacheLen = Union[int, torch.Tensor]
FLEX_BLOCK = 128  # FlexAttention's block size


def lengths(cache_len: CacheLen, q: torch.Tensor) -> torch.Tensor:
    """cache_len as an int64 tensor shaped q.shape[:-2] (a broadcast view: one length per head of a sequence)."""
    lead = q.shape[:-2]
    t = torch.as_tensor(cache_len, device=q.device)
    t = t.reshape(t.shape + (1,) * (len(lead) - t.dim()))
    return t.to(torch.int64).expand(lead)


def visible(cache_len: CacheLen, q: torch.Tensor, max_len: int, window: Optional[int] = None) -> torch.Tensor:
    """(..., n_new, max_len) bool: which cache positions each query sees."""
    n_new = q.shape[-2]
    query_pos = lengths(cache_len, q)[..., None] - n_new + torch.arange(n_new, device=q.device)  # (..., n_new)
    keys = torch.arange(max_len, device=q.device)
    seen = keys <= query_pos[..., None]
    if window is not None:
        seen &= keys > query_pos[..., None] - window
    return seen


def repeat_kv(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The cache t (..., kv heads, max_len, d) with each head repeated for its group of q's heads: the readable
    versions' GQA (a copy; the Triton decode kernel reads each cache head in place)."""
    return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) if t.shape[-3] != q.shape[-3] else t


def capped(scores: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def decode_naive(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                 scale: float, window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked to the visible positions) v, with the (n_new, max_len) scores in memory."""
    scores = capped(torch.matmul(q, repeat_kv(k_cache, q).transpose(-2, -1)) * scale, softcap)
    scores = scores.masked_fill(~visible(cache_len, q, k_cache.shape[-2], window), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v_cache, q))


def decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                scale: float, window: Optional[int] = None) -> torch.Tensor:
    """scaled_dot_product_attention with the visibility as a boolean mask (PyTorch picks a kernel that takes one)."""
    mask = visible(cache_len, q, k_cache.shape[-2], window)
    if q.dim() == 4:
        gqa = {"enable_gqa": True} if k_cache.shape[-3] != q.shape[-3] else {}
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale, **gqa)
    # The fused kernels want (batch, heads, seq, d): fold any other leading dims into two.
    k_cache, v_cache = repeat_kv(k_cache, q), repeat_kv(v_cache, q)
    q4, k4, v4, m4 = (t.reshape((-1, 1) + tuple(t.shape[-2:])) for t in (q, k_cache, v_cache, mask))
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=m4, scale=scale).reshape(q.shape)


register_decode("naive", variants=("gqa", "window", "softcap"))(decode_naive)
register_decode("sdpa", variants=("gqa", "window"))(decode_sdpa)


def _flex_decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"FlexAttention's kernels need d_head a power of two >= 16, got {d}"
    # On the CPU its compiled kernels came out wrong for some cache sizes (40: off by 1e-2, block mask or not) and
    # failed to compile for a batch of 1 (an Inductor lowering error).
    if q.device.type != "cuda":
        return f"FlexAttention's decode needs CUDA tensors, got {q.device.type}"
    if k_cache.shape[-2] % FLEX_BLOCK:
        return f"FlexAttention's decode needs a cache size that is a multiple of {FLEX_BLOCK}, got {k_cache.shape[-2]}"
    return None


@functools.cache
def _compiled_flex_decode():
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
        n_new = q.shape[-2]

        def visible_only(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= lens[b, h] - n_new + q_idx, score, -float("inf"))

        # Visibility as a score_mod over the whole cache rather than in the block mask: that mask would depend on
        # cache_len's values, and rebuilding it each step costs more than the decode. Positions past cache_len are
        # still read.
        return flex_attention(q, k, v, score_mod=visible_only, scale=scale)

    # Compiled as a whole, so the score_mod's closure over the lengths is traced, not recompiled per call.
    return torch.compile(run, dynamic=False)


@register_decode("flex", input_check=_flex_decode_problem)
def decode_flex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                scale: float) -> torch.Tensor:
    """FlexAttention with the visibility as a score_mod."""
    q4, k4, v4 = (t.reshape((-1, 1) + tuple(t.shape[-2:])) if t.dim() != 4 else t for t in (q, k_cache, v_cache))
    lens = lengths(cache_len, q).reshape(q4.shape[:2])
    return _compiled_flex_decode()(q4, k4, v4, lens, scale).reshape(q.shape)
