"""`adamw-bf16`: AdamW with its moments in bf16, one kernel per parameter that also writes the weight's bf16 copy.

An AdamW step is memory-bound. torch's fused kernel reads the fp32 weight, its gradient and both moments and writes
the weight and the moments: 28 bytes per parameter. With bf16 moments that is 20. The same pass can also write the
bf16 copy of each weight that the bf16 forward reads (model.layers.Linear.keep_weight_copy), 2 bytes more; autocast
would otherwise cast each weight again in every forward, 6 bytes in a kernel of its own. And the clipping factor is
applied as the gradient is read, instead of in a pass over the gradients before the step.

torch.optim's AdamW keeps its state in the parameters' dtype (its fused and foreach kernels refuse mixed dtypes), so
this is an `Optimizer` of its own. Under FSDP each rank updates its own shards (the update is elementwise) and keeps
their moments as DTensors sharded like them, which sharded checkpoints save as they save torch's; there are no weight
copies then, since FSDP casts each weight as it all-gathers it. 12 bytes a parameter instead of 16 leaves a 10B model
on two GPUs room for a larger batch. On CUDA the update is a Triton kernel (adamw_bf16_kernel.py), which reads the
step count, the learning rate and the clipping factor from device tensors, so that a CUDA graph can capture it;
elsewhere the same update in torch ops (`_update`, also the kernel's reference in the tests).

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), computed in fp32; only the
stored moments are rounded to `state_dtype`. bf16 keeps 8 bits of mantissa: a moment changes as long as its update
moves it by more than 2^-9 of itself, which (1 - beta2) = 0.05 does (beta2 = 0.999 would stall v).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import triton
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from training.optim.registry import BETAS, EPS, OptimizerSettings, param_groups, register


def _update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            step: torch.Tensor, lr: torch.Tensor, grad_scale: Optional[torch.Tensor], beta1: float, beta2: float,
            eps: float, weight_decay: float, copy: Optional[torch.Tensor]) -> None:
    """One AdamW step of one flat parameter in torch ops, in place (its moments, its weight and, if given, its
    low-precision copy); `step` is the count including this step. The CPU path, and the kernel's reference."""
    g = grad.float() if grad_scale is None else grad.float() * grad_scale
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g * g
    step_size = lr / (1 - beta1 ** step)
    denom = v.sqrt() / (1 - beta2 ** step).sqrt() + eps
    p = param * (1 - lr * weight_decay) - step_size * m / denom
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if copy is not None:
        copy.copy_(p)


BLOCK, NUM_WARPS = 1024, 4  # the fastest of a sweep of block sizes and warps: 92% of the copy bandwidth


def _log2(beta: float) -> float:
    return -math.inf if beta == 0 else math.log2(beta)  # beta ** step = 2 ** (step * log2(beta)), 0 for beta 0


def _launch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            step: torch.Tensor, lr: torch.Tensor, grad_scale: Optional[torch.Tensor], beta1: float, beta2: float,
            eps: float, weight_decay: float, copy: Optional[torch.Tensor]) -> None:
    """_update as one Triton kernel (adamw_bf16_kernel.py)."""
    from training.optim.adamw_bf16_kernel import adamw_step

    n = param.numel()
    # Without a scale, any pointer stands in for it: HAS_SCALE=False never reads it.
    adamw_step[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, param if copy is None else copy, step, lr,
        lr if grad_scale is None else grad_scale, n, beta1, beta2, _log2(beta1), _log2(beta2), eps, weight_decay,
        HAS_COPY=copy is not None, HAS_SCALE=grad_scale is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this rank's elements of `t`: an FSDP DTensor's local shard, and within a wrapper
    subclass (float8 all-gather wraps the weights) its one inner tensor of `t`'s shape, which the kernel reads."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names if getattr(t, name).shape == t.shape]
        if len(inner) != 1:
            raise TypeError(f"AdamW updates plain tensors; a {type(t).__name__} holds no single tensor of its shape")
        return _local(inner[0])
    return t


class AdamW(torch.optim.Optimizer):
    """AdamW(params, lr, betas, eps, weight_decay, state_dtype=torch.bfloat16, weight_copies={weight: copy}).

    weight_copies: low-precision copies (model.layers.Linear.keep_weight_copy) that each step rewrites from the
    updated weight. `step(clip_coef=t)` multiplies every gradient by the 0-dim tensor t first (the clipping
    coefficient), without a pass over the gradients of its own. Always capturable: the step count, the learning
    rate (if given as a tensor) and the scale stay on the device.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 state_dtype: torch.dtype = torch.bfloat16,
                 weight_copies: Optional[Mapping[nn.Parameter, torch.Tensor]] = None):
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamW's betas must be in [0, 1); beta{i + 1} is {beta}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW's eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True))
        self.state_dtype = state_dtype
        copies = weight_copies or {}
        own = [p for group in self.param_groups for p in group["params"]]
        # Only this optimizer's parameters' copies (one optimizer per parameter when stepped in the backward).
        self.weight_copies = {p: copies[p] for p in own if p in copies}
        for p in own:
            if not p.is_contiguous():
                raise ValueError(f"AdamW updates parameters as flat views: one of shape {tuple(p.shape)} is "
                                 "not contiguous")
            copy = self.weight_copies.get(p)
            if copy is not None and (copy.shape != p.shape or not copy.is_contiguous()):
                raise ValueError(f"the weight copy of a parameter of shape {tuple(p.shape)} is "
                                 f"{tuple(copy.shape)}{'' if copy.is_contiguous() else ', not contiguous'}")

    def _state_of(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None,
             clip_coef: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if isinstance(clip_coef, DTensor):  # under FSDP, from the norm of all shards: one value, gathered once
            clip_coef = clip_coef.full_tensor()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = params[0].device
            lr = group["lr"]
            # The kernel reads the learning rate on the device: a float one is filled there (a kernel launch, no
            # host-to-device copy to wait for).
            lr = lr.to(device) if isinstance(lr, torch.Tensor) else torch.full((), lr, device=device)
            scale = None if clip_coef is None else clip_coef.to(device)
            update = _launch if device.type == "cuda" else _update
            beta1, beta2 = group["betas"]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("AdamW does not support sparse gradients")
            states = [self._state_of(p) for p in params]
            torch._foreach_add_([state["step"] for state in states], 1.0)  # one launch for the group's counts
            for p, state in zip(params, states):
                copy = self.weight_copies.get(p)
                update(_local(p).view(-1), _local(p.grad).reshape(-1), _local(state["exp_avg"]).view(-1),
                       _local(state["exp_avg_sq"]).view(-1), state["step"], lr, scale, beta1, beta2, group["eps"],
                       group["weight_decay"], None if copy is None else copy.view(-1))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but each moment is copied straight to `state_dtype` on its parameter's device: torch's would
        first cast every moment to its parameter's dtype, fp32 copies of all of them at once (8 bytes a parameter
        more than the state being loaded). An fp32 torch.optim.AdamW state loads too (and this state into it)."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        rest: dict[Any, dict[str, Any]] = {}
        for i, entry in state_dict["state"].items():
            moments[i] = {key: value for key, value in entry.items() if key in ("exp_avg", "exp_avg_sq")}
            rest[i] = {key: value for key, value in entry.items() if key not in moments[i]}
        super().load_state_dict({**state_dict, "state": rest})
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in moments.get(i, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=self.state_dtype, copy=True)
        for p, state in self.state.items():
            if "step" in state:  # on the device (a state that was not capturable counts on the CPU), and a tensor of
                # its own: a state dict shares its tensors, and this count is incremented in place
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32, copy=True)
        for group in self.param_groups:
            group["capturable"] = True


@register("adamw-bf16", description="AdamW with bf16 moments; its update also writes the bf16 weight copies the "
                                    "forward reads", steps_in_backward=True, keeps_weight_copies=True,
          state_layout="adamw")
def build(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> AdamW:
    return AdamW(param_groups(model, params, s), lr=s.lr, betas=BETAS, eps=EPS,
                 state_dtype=torch.bfloat16, weight_copies=s.weight_copies)
