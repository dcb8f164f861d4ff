"""The module a step calls under --parallel: the model itself, DistributedDataParallel, or the model fully sharded."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from training.parallel.distributed import DistContext

DDP_BUCKET_MB = 100
# The only buffers are RoPE's tables, computed alike on every rank: DDP's broadcast of them before each forward
# copied them for nothing (2.9 ms a step of `large`). torch >= 2.13 deprecates broadcast_buffers for
# forward_sync_buffers (which still syncs the buffers once, at construction).
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
                   else {"broadcast_buffers": False})


def wrap_model(model: nn.Module, ctx: DistContext, dtype: torch.dtype) -> nn.Module:
    """The module to call for training: the model itself, DistributedDataParallel, or the model fully sharded.

    FSDP: shard_blocks_and_root. The model's parameters must be identical on every rank (same seed): DDP broadcasts
    rank 0's, FSDP keeps each rank's shard.
    """
    if ctx.parallel == "none":
        return model
    if ctx.parallel == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buckets of 100 MB, not DDP's 25: a `large` model's 3.9 GB of fp32 gradients in 39 all-reduces rather than
        # 155 overlap the backward better (results/README.md, two GPUs).
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                                   bucket_cap_mb=DDP_BUCKET_MB, **_NO_BUFFER_SYNC)
    if ctx.parallel == "fsdp":
        shard_blocks_and_root(model, ctx, dtype)
        return model
    raise ValueError(f"unknown parallel mode {ctx.parallel!r}")


def reshards_after_forward(index: int, n_blocks: int) -> bool:
    """Whether block `index` frees its gathered weights after its forward: all but the last, whose weights the
    backward needs first, at once, with no compute before it to hide a second all-gather behind."""
    return index < n_blocks - 1


def shard_blocks_and_root(model: nn.Module, ctx: DistContext, dtype: torch.dtype) -> None:
    """FSDP2 in place, as torchtitan applies it: each block its own unit (one all-gather and one reduce-scatter per
    block, overlapped with the neighbouring blocks' compute by FSDP2's implicit prefetching), then the root
    (embedding, final norm, LM head), kept gathered from its forward to its backward.

    Under bf16 the blocks compute from all-gathered bf16 copies of the fp32 master weights and reduce-scatter fp32
    gradients. Blocks already compiled (training/compilation.py) stay compiled per block: FSDP's hooks run around
    each block's call, outside its compiled forward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if dtype == torch.bfloat16 else MixedPrecisionPolicy())
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    n = len(model.blocks)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshards_after_forward(i, n))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def free_gathered_weights(model: nn.Module) -> None:
    """Reshard what FSDP keeps gathered after a forward for the backward that follows (the root and the last block):
    after an evaluation no backward follows, and the parameters are then their shards again. A no-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
