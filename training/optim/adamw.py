"""`adamw`: torch.optim.AdamW (fused on CUDA, fp32 moments), with the clipping coefficient applied in `step`."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from training.optim.registry import BETAS, EPS, OptimizerSettings, param_groups, register


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step(clip_coef=t) first scales every gradient by the 0-dim tensor t."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, clip_coef: Optional[torch.Tensor] = None):
        if clip_coef is not None:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        return super().step(closure)


@register("adamw", description="torch.optim.AdamW, fp32 moments, fused on CUDA", steps_in_backward=True)
def build(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> AdamW:
    return AdamW(param_groups(model, params, s), lr=s.lr, betas=BETAS, eps=EPS,
                 fused=s.device.type == "cuda", capturable=s.capturable)
