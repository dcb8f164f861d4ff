"""Regional compilation, as torchtitan does it: each block compiled on its own, and the LM head with the loss.

The blocks all run the same code, so compiling each block's forward gives one graph that every block reuses: Dynamo
caches compiled code on the code object (`Block.forward`) and its guards do not name the block (parameters and the
RoPE tables are graph inputs). Compile time is one block's whatever the depth, and a whole-model compile measured no
faster (results/README.md, design choices). `loss_from_hidden` (final norm, LM head, fp32 upcast, cross-entropy)
is one more region, so no eager code writes a (batch, seq, vocab) fp32 logits tensor.

Why the instance's `forward` and not `block.compile()`: nn.Module.compile compiles `Module._call_impl`, a frame Dynamo
skips, and under activation checkpointing (Dynamo-disabled) nothing would be compiled, silently. Compiling `forward`
after `checkpoint_blocks` traces the checkpoint as a higher-order op, and keeps module hooks (FSDP's all-gather and
reshard) outside compiled code. Parameter names, hence checkpoints, do not change.
"""

from __future__ import annotations

from typing import Callable

import torch

from model import TransformerLM

def compile_regions(model: TransformerLM, dynamic: bool | None = False,
                    backend: str | Callable = "inductor") -> TransformerLM:
    """Compile each block's forward and `loss_from_hidden` in place (after checkpoint_blocks, before FSDP)."""
    for block in model.blocks:
        if not getattr(block, "_compiled_region", False):
            block.forward = torch.compile(block.forward, dynamic=dynamic, backend=backend)
            block._compiled_region = True
    if not getattr(model, "_compiled_region", False):
        model.loss_from_hidden = torch.compile(model.loss_from_hidden, dynamic=dynamic, backend=backend)
        model._compiled_region = True
    return model
