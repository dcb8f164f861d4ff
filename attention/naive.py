"""`naive` (the reference: materialises the full softmax) and `compiled` (torch.compile of it)."""

from __future__ import annotations

import functools

import torch

from attention.registry import register
from profiling import nvtx


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v with the (seq_q, seq_k) score matrix in memory."""
    # NVTX ranges (no-ops unless bench_model.py --nvtx) split the time nsys shows into the three phases.
    with nvtx.range("attention.scores"):
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., seq_q, seq_k)
        if causal:
            n = q.shape[-2]
            above_diagonal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above_diagonal, float("-inf"))
    with nvtx.range("attention.softmax"):
        probs = torch.softmax(scores, dim=-1)
    with nvtx.range("attention.output"):
        return torch.matmul(probs, v)


register("naive", description="plain PyTorch; materialises the (seq x seq) softmax; the reference")(naive_attention)


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
)
def compiled_attention(q, k, v, causal, scale):
    return _compiled_naive()(q, k, v, causal, scale)
