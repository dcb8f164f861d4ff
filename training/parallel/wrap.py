"""The module a step calls under --parallel: the model itself, DistributedDataParallel, or the model fully sharded."""

from __future__ import annotations

import torch
from torch import nn

from training.parallel.distributed import DistContext

DDP_BUCKET_MB = 100


def wrap_model(model: nn.Module, ctx: DistContext, dtype: torch.dtype) -> nn.Module:
    """The module to call for training: the model itself, DistributedDataParallel, or the model fully sharded.

    FSDP shards each block, then the root (embedding, final norm, LM head). Under bf16 the blocks compute in bf16
    from all-gathered bf16 copies of fp32 master weights and reduce-scatter gradients in fp32. The model's
    parameters must be identical on every rank (same seed): DDP broadcasts rank 0's, FSDP keeps each rank's shard.
    """
    if ctx.parallel == "none":
        return model
    if ctx.parallel == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buckets of 100 MB, not DDP's 25: a `large` model's 3.9 GB of fp32 gradients in 39 all-reduces rather than
        # 155 overlap the backward better (results/README.md, two GPUs).
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                                   bucket_cap_mb=DDP_BUCKET_MB)
    if ctx.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if dtype == torch.bfloat16 else MixedPrecisionPolicy())
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    raise ValueError(f"unknown parallel mode {ctx.parallel!r}")
