"""Activation checkpointing: keep only each block's input for backward and recompute the block's inside there.

Two policies (`--recompute`): `full` recomputes the whole block; `selective` is torchtitan's per-op policy: the outputs
of the matmuls and of attention are kept, and only what is cheap to redo (norms, RoPE, SwiGLU's product, casts and
views) is recomputed, so the backward redoes almost no FLOPs for a fraction of the activations of no checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("full", "selective")


def _kept_ops() -> set[Any]:
    """The ops whose outputs the selective policy keeps: matmuls (float8's too), attention (its output and softmax
    statistics), and max, as torchtitan keeps it: float8 scales come from absolute maxima, which are tiny to keep."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "max", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


_KEPT = _kept_ops()

_KEPT_CUSTOM = {"flash_lm::flash_attn_fwd"}  # the flash backend's attention, as an op (attention/flash/api.py)


def keep_or_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy for one op of a block's forward: keep what a matmul or attention produced, recompute the
    rest (the fused RoPE and SwiGLU kernels included: they are cheap)."""
    kept = op in _KEPT or (isinstance(op, torch._ops.OpOverload) and op.name() in _KEPT_CUSTOM)
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(keep_or_recompute)


def checkpoint_blocks(model: nn.Module, policy: str = "full") -> None:
    """Recompute every block of `model.blocks` in backward instead of storing its activations (all of them, or, with
    policy "selective", all but the matmuls' and attention's outputs).

    Full recomputation trades about one extra forward per step for activation memory of one block instead of all.
    The block's forward is replaced on the instance, so parameter names (and checkpoints) do not change,
    and FSDP's hooks, which run around the module call, still gather the weights before the recomputation.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown recomputation policy {policy!r}; valid: {', '.join(POLICIES)}")
    extra = {"context_fn": _selective_contexts} if policy == "selective" else {}
    for block in model.blocks:
        if getattr(block, "_recomputed_in_backward", False):
            continue
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)
        block._recomputed_in_backward = True
