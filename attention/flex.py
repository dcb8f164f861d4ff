"""`flex`: FlexAttention, compiled, with a cached causal block mask."""

from __future__ import annotations

import functools

import torch

from attention.registry import register

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


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq: int, device: str):
    # Same mask for every batch and head (B=None, H=None broadcast), so one per (seq, device).
    return create_block_mask(_causal, None, None, seq, seq, device=device)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@register(
    "flex",
    description="FlexAttention (torch.compile'd), cached causal block mask",
    environment_check=_flex_unavailable,
    input_check=_flex_input_check,
)
def flex(q, k, v, causal, scale):
    shape = q.shape
    q4, k4, v4 = (t.reshape(-1, 1, t.shape[-2], t.shape[-1]) if t.dim() != 4 else t for t in (q, k, v))
    mask = _causal_block_mask(q.shape[-2], str(q.device)) if causal else None
    return _compiled_flex()(q4, k4, v4, block_mask=mask, scale=scale).reshape(shape)
