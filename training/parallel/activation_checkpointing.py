"""Activation checkpointing: keep only each block's input for backward and recompute the block's inside there."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute every block of `model.blocks` in backward instead of storing its activations.

    Trades about one extra forward per step for activation memory of one block instead of all of them.
    The block's forward is replaced on the instance, so parameter names (and checkpoints) do not change,
    and FSDP's hooks, which run around the module call, still gather the weights before the recomputation.
    """
    for block in model.blocks:
        if getattr(block, "_recomputed_in_backward", False):
            continue
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        block._recomputed_in_backward = True
