"""`flex`: FlexAttention, compiled, with cached block masks.

Variants: GQA through enable_gqa; windows and documents as a mask_mod (its block mask skips the blocks no query
sees); softcap as a score_mod. Block masks without documents are cached per (causal, window, lengths, device);
with documents, those of the last doc_ids tensor are kept (one per causal and window) for as long as it comes back
(every layer of an eager step, local and global). Inside compiled code each call builds its document mask again:
the cache's keys are a tensor's address and version, which the compiler cannot guard on.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from attention.registry import kv_groups, register

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = None


def _flex_unavailable() -> str | None:
    if flex_attention is None:
        return f"FlexAttention needs torch >= 2.5, this is {torch.__version__}"
    if not torch._dynamo.is_dynamo_supported():
        return "FlexAttention needs torch.compile, which is not supported here"
    return None


def _flex_input_check(q, k, v, causal):
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"FlexAttention's kernels need d_head a power of two >= 16, got {d}"
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "FlexAttention has no backward on the CPU (a PyTorch limitation); run forward-only or on CUDA"
    return None


def _flex_variant_check(q, k, v, causal, variant) -> Optional[str]:
    lengths = (q.shape[-2], k.shape[-2])
    if q.is_cuda and kv_groups(q, k) > 1 and any(n % 128 for n in lengths):
        # Inductor finds no kernel config to lower it with (NoValidChoicesError): with torch 2.11 on an H100, GQA
        # at length 100 failed for d_head 32 and 64, and 128 and 256 ran.
        return (f"FlexAttention's CUDA kernel fails to compile grouped-query attention at lengths that are not "
                f"multiples of 128, got {lengths[0]} and {lengths[1]}")
    return None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq: int, device: str):
    # Same mask for every batch and head (B=None, H=None broadcast), so one per (seq, device).
    return create_block_mask(_causal, None, None, seq, seq, device=device)


def _mask_mod(causal: bool, window: Optional[int], doc_ids: Optional[torch.Tensor]) -> Callable:
    """The registry's visibility rule as a FlexAttention mask_mod; doc_ids, if any, is (batch, seq)."""

    def visible(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx if causal else q_idx >= 0
        if window is not None:
            keep = keep & ((q_idx - kv_idx < window) if causal else ((q_idx - kv_idx).abs() < window))
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        return keep

    return visible


@functools.lru_cache(maxsize=32)
def _window_block_mask(causal: bool, window: int, n_q: int, n_k: int, device: str):
    return create_block_mask(_mask_mod(causal, window, None), None, None, n_q, n_k, device=device)


# The block masks of the last doc_ids tensor seen, one per (causal, window, lead, n): the layers of a step share them,
# local and global alike. The tensor itself is kept, so that its memory cannot pass to another tensor meanwhile.
_doc_masks: dict = {"key": None, "ids": None, "masks": {}}


def _doc_block_mask(causal: bool, window: Optional[int], doc_ids: torch.Tensor, lead: tuple[int, ...], n: int):
    ids = doc_ids.expand(*lead, n).reshape(-1, n)  # (batch, n), batch as in _as_bhsd(q)
    batch = ids.shape[0]
    if torch.compiler.is_compiling():
        return create_block_mask(_mask_mod(causal, window, ids), batch, None, n, n, device=ids.device)
    key = (doc_ids.data_ptr(), doc_ids._version, tuple(doc_ids.shape), doc_ids.stride())
    if _doc_masks["key"] != key:
        _doc_masks.update(key=key, ids=doc_ids, masks={})
    masks = _doc_masks["masks"]
    if (causal, window, lead, n) not in masks:
        masks[causal, window, lead, n] = create_block_mask(_mask_mod(causal, window, ids), batch, None, n, n,
                                                           device=ids.device)
    return masks[causal, window, lead, n]


@functools.lru_cache(maxsize=8)
def _softcap_mod(softcap: float) -> Callable:
    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped


def _as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(..., heads, seq, d) -> (batch, heads, seq, d); (seq, d) -> (1, 1, seq, d)."""
    return t.reshape((1,) * max(0, 4 - t.dim()) + tuple(t.shape)) if t.dim() <= 4 else t.reshape(-1, *t.shape[-3:])


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@register(
    "flex",
    description="FlexAttention (torch.compile'd), cached causal block mask",
    environment_check=_flex_unavailable,
    input_check=_flex_input_check,
    variants=("gqa", "window", "softcap", "doc_ids"),
    variant_check=_flex_variant_check,
)
def flex(q, k, v, causal, scale, window: Optional[int] = None, softcap: Optional[float] = None,
         doc_ids: Optional[torch.Tensor] = None):
    shape = q.shape
    if window is None and softcap is None and doc_ids is None and kv_groups(q, k) == 1:
        q4, k4, v4 = (t.reshape(-1, 1, t.shape[-2], t.shape[-1]) if t.dim() != 4 else t for t in (q, k, v))
        mask = _causal_block_mask(q.shape[-2], str(q.device)) if causal else None
        return _compiled_flex()(q4, k4, v4, block_mask=mask, scale=scale).reshape(shape)
    q4, k4, v4 = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    n_q, n_k = q4.shape[-2], k4.shape[-2]
    if doc_ids is not None:
        mask = _doc_block_mask(causal, window, doc_ids, tuple(q.shape[:-3]), n_q)
    elif window is not None:
        mask = _window_block_mask(causal, window, n_q, n_k, str(q.device))
    else:
        mask = _causal_block_mask(n_q, str(q.device)) if causal else None
    extra = {"enable_gqa": True} if kv_groups(q, k) > 1 else {}
    o = _compiled_flex()(q4, k4, v4, block_mask=mask, scale=scale,
                         score_mod=None if softcap is None else _softcap_mod(softcap), **extra)
    return o.reshape(shape)
