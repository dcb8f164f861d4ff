"""`naive` (the reference: materialises the full softmax) and `compiled` (torch.compile of it)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from attention.masks import visible_mask
from attention.registry import VARIANTS, kv_groups, register
from profiling import nvtx


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v with the (seq_q, seq_k) score matrix in memory; every variant (registry.py)."""
    groups = kv_groups(q, k)
    if groups > 1:  # (..., h_kv, group, n, d) queries against (..., h_kv, 1, n, d) keys: K, V broadcast, not copied
        o = _attention(q.unflatten(-3, (k.shape[-3], groups)), k.unsqueeze(-3), v.unsqueeze(-3), causal, scale,
                       window, softcap, None if doc_ids is None else doc_ids.unsqueeze(-2))
        return o.flatten(-4, -3)
    return _attention(q, k, v, causal, scale, window, softcap, doc_ids)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: Optional[int],
               softcap: Optional[float], doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
    # NVTX ranges (no-ops unless bench_model.py --nvtx) split the time nsys shows into the three phases.
    with nvtx.range("attention.scores"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., seq_q, seq_k)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if causal and window is None and doc_ids is None:
            n = q.shape[-2]
            above_diagonal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above_diagonal, float("-inf"))
        elif (mask := visible_mask(q.shape[-2], k.shape[-2], causal, window, doc_ids, q.device)) is not None:
            if doc_ids is not None and q.dim() >= 3:
                mask = mask.unsqueeze(-3)  # doc_ids has no head dim
            scores = scores.masked_fill(~mask, float("-inf"))
    with nvtx.range("attention.softmax"):
        probs = torch.softmax(scores, dim=-1)
    with nvtx.range("attention.output"):
        return torch.matmul(probs, v)


register("naive", description="plain PyTorch; materialises the (seq x seq) softmax; the reference",
         variants=tuple(VARIANTS))(naive_attention)


@functools.cache
def _compiled_naive():
    # Built on first use: torch.compile is cheap to wrap but we keep import of this module free.
    return torch.compile(naive_attention)


def _compile_unavailable() -> str | None:
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform"
    return None


@register(
    "compiled",
    description="torch.compile of naive: fused elementwise work, still O(seq^2) memory",
    environment_check=_compile_unavailable,
    variants=tuple(VARIANTS),
)
def compiled_attention(q, k, v, causal, scale, **variant):
    return _compiled_naive()(q, k, v, causal, scale, **variant)
