"""Regional compilation, as torchtitan does it: each block compiled on its own, and the LM head with the loss.

`torch.compile(model)` traces the whole model into one graph, n_layers copies of the same block, so its compile
time grows with depth (and so does the recompilation after any guard failure). The blocks all run the same code, so
compiling each block's forward instead gives one graph that every block reuses: Dynamo caches compiled code on the
code object (`Block.forward`, shared by all blocks) and its guards do not name the block (parameters are graph
inputs, not constants: `inline_inbuilt_nn_modules`, always on in recent PyTorch). Compile time is about one
block's, whatever the depth; tests/training/test_compilation.py checks that n blocks trigger a single compile
(RotaryEmbedding's tables are buffers: graph inputs, like the parameters, not constants of one block).

`loss_from_hidden` (final norm, LM head, fp32 upcast, cross-entropy) is compiled as one more region: Inductor
fuses the upcast into the log-softmax, so no eager code writes a (batch, seq, vocab) fp32 logits tensor (under bf16
autocast on the CPU, the compiled forward and backward hold the logits in bf16 only, plus fp32 row statistics).
The embedding and the loop over the blocks stay eager: a few kernel launches per block, small next to its matmuls.

Why not `block.compile()`: nn.Module.compile compiles `Module._call_impl`, a frame Dynamo skips (torch.nn is in
its skip list); it then compiles the frames called from there. That is `Block.forward`, except under activation
checkpointing, whose `torch.utils.checkpoint` is Dynamo-disabled: nothing would be compiled, silently. Compiling
the instance's `forward` (after `checkpoint_blocks`) traces the checkpoint as a higher-order op instead, and keeps
module hooks (FSDP's all-gather and reshard) outside compiled code, as torchtitan's order (checkpoint, compile,
then fully_shard) does. Parameter names, hence checkpoints, do not change.
"""

from __future__ import annotations

from typing import Callable

import torch

from model import TransformerLM

COMPILE_SCOPES = ("blocks", "model")  # train.py / bench_model.py --compile-scope


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
