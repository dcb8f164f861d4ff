"""`muon`: Muon for the blocks' hidden matrices, AdamW for the rest (embedding, LM head, norm gains), as one optimizer.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/) replaces a matrix's update by its orthogonalised
momentum: a few Newton-Schulz iterations push the singular values of the momentum towards 1, so that the update
moves every direction of the matrix by about as much. It is meant for hidden matrices: the embedding is a lookup
table, the LM head's rows are per-token logits and the norm gains are vectors, and AdamW keeps those.

The hidden matrices follow torch.optim.Muon (PyTorch 2.9 and later): its hyper-parameters, its per-matrix state
("momentum_buffer", so checkpoints of either load in the other) and its update, with
- adjust_lr_fn="match_rms_adamw": each update is scaled by 0.2 * sqrt(max(rows, cols)), so that its RMS is about
  AdamW's (0.2) and the run's --lr and --weight-decay serve both parts (Moonshot AI, "Muon is Scalable for LLM
  Training", https://arxiv.org/abs/2502.16982, section 2.2: AdamW's learning rate and weight decay, reused);
- momentum 0.95 with Nesterov, and 5 Newton-Schulz steps of the quintic (3.4445, -4.7750, 2.0315) in bf16 on the
  momentum divided by its Frobenius norm: the defaults of Keller Jordan's Muon and of modded-nanogpt's speedruns
  (https://github.com/KellerJordan/modded-nanogpt), which torch.optim.Muon also takes.
GroupedMuon replaces torch.optim.Muon for speed: the matrices of one shape are orthogonalised together by batched
matmuls (a few launches per shape, not several per matrix), and the learning rate may be a device tensor, so the step
can be captured in a CUDA graph (torch.optim.Muon reads it on the host); it needs no particular PyTorch version.
The rest is training/optim/adamw.py's AdamW (fused on CUDA) with the run's --lr and --weight-decay.

This model's q, k and v projections are one matrix (model/transformer.py): Muon orthogonalises it whole, where
modded-nanogpt orthogonalises q, k and v apart. What it cannot run with, declared to the registry: FSDP's shards
(Newton-Schulz needs whole matrices) and a step during the backward (the overlap hides memory-bound updates;
Newton-Schulz is matmuls). Under DDP every rank computes the same update from the all-reduced gradients.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from training.optim.adamw import AdamW
from training.optim.registry import BETAS, EPS, OptimizerSettings, param_groups, register

MOMENTUM = 0.95
NESTEROV = True
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # the least norm divided by, as torch.optim.Muon's
ADJUST_LR = "match_rms_adamw"


def hidden_matrices(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`params` split into the blocks' 2-D weights (qkv, out, the MLP's) and the rest, each in model order."""
    in_blocks = {id(p) for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2}
    return [p for p in params if id(p) in in_blocks], [p for p in params if id(p) not in in_blocks]


def newton_schulz(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float],
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of each matrix of the stack x (n, rows, cols), rows <= cols, in x's dtype:
    x divided by its Frobenius norm (at least eps), then `steps` iterations x <- a x + (b A + c A^2) x, A = x x^T."""
    a, b, c = coefficients
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (n, rows, rows)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def lr_ratio(adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """torch.optim.Muon's factor on the learning rate of a (rows, cols) matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def by_shape(*lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """Parallel lists (the first: the parameters) split into runs of one shape, dtype and device, in first-seen
    order."""
    runs: dict[tuple, tuple[list[torch.Tensor], ...]] = {}
    for items in zip(*lists):
        p = items[0]
        run = runs.setdefault((p.shape, p.dtype, p.device), tuple([] for _ in lists))
        for column, item in zip(run, items):
            column.append(item)
    return list(runs.values())


class GroupedMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update, hyper-parameters (its param_groups' keys) and state ("momentum_buffer" per matrix),
    with a step that orthogonalises the matrices of one shape as one stack in `ns_dtype` (bf16, as torch's; float32
    or float64 to compare with an exact reference) and reads the learning rate as a number or a tensor without
    waiting for the host (capturable in a CUDA graph)."""

    def __init__(self, params: list[nn.Parameter], lr: float | torch.Tensor, weight_decay: float,
                 momentum: float = MOMENTUM, nesterov: bool = NESTEROV,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS,
                 ns_steps: int = NS_STEPS, adjust_lr_fn: Optional[str] = ADJUST_LR,
                 ns_dtype: torch.dtype = torch.bfloat16):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        capturable=True)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon updates matrices; got a parameter of shape {tuple(p.shape)}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # load_state_dict's groups may be torch.optim.Muon's, without the flag
        for group in self.param_groups:
            group.setdefault("capturable", True)

    def _init_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    bufs: list[torch.Tensor]) -> None:
        """The group's parameters that have a gradient, their gradients and momenta (zeros at first)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> None:
        if closure is not None:
            raise ValueError("GroupedMuon.step takes no closure")
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            for run in by_shape(params, grads, bufs):
                self._step_stack(group, *run)

    def _step_stack(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    bufs: list[torch.Tensor]) -> None:
        """Momentum, Newton-Schulz, weight decay and update for n matrices of one shape (rows, cols)."""
        momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        rows, cols = params[0].shape
        x = torch.empty((len(params), rows, cols), dtype=self.ns_dtype, device=params[0].device)
        torch._foreach_copy_(list(x.unbind(0)), updates)  # (n, rows, cols), one cast for the stack
        wide = rows <= cols  # Newton-Schulz on the side with fewer rows, as torch.optim.Muon
        ortho = newton_schulz(x if wide else x.mT, group["ns_steps"], group["ns_coefficients"], group["eps"])
        # -lr * ratio as a (1, 1, 1) tensor of the parameters' dtype: the product below is then computed in it.
        scale = torch.full((1, 1, 1), -lr_ratio(group["adjust_lr_fn"], params[0].shape), dtype=params[0].dtype,
                           device=params[0].device).mul_(lr)
        step = torch.mul(ortho if wide else ortho.mT, scale,
                         out=torch.empty((len(params), rows, cols), dtype=params[0].dtype, device=params[0].device))
        if wd != 0:
            decay = 1 - lr * wd
            torch._foreach_mul_(params, decay.to(params[0].device) if isinstance(decay, torch.Tensor) else decay)
        torch._foreach_add_(params, list(step.unbind(0)))


class MuonAdamW:
    """GroupedMuon over the hidden matrices and AdamW over the rest, driven as one optimizer: `step(clip_coef=)`,
    `param_groups`, `zero_grad`, `state_dict`/`load_state_dict`; `.optimizers` lists the two (checkpoints save and
    load their states by parameter name through that list: training/checkpoint/resume.py)."""

    def __init__(self, muon: GroupedMuon, adamw: torch.optim.AdamW):
        self.optimizers: list[torch.optim.Optimizer] = [muon, adamw]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Both optimizers' groups (the dicts themselves: set_lr sets each part's learning rate)."""
        return [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, clip_coef: Optional[torch.Tensor] = None) -> None:
        """Scale every gradient by `clip_coef` (one foreach kernel for both parts), then step Muon and AdamW."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure: the training step computes the loss")
        if clip_coef is not None:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon_adamw": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state.get("muon_adamw")
        if parts is None or len(parts) != len(self.optimizers):
            raise ValueError("this optimizer state is not a MuonAdamW's (Muon's, then AdamW's)")
        for opt, part in zip(self.optimizers, parts):
            opt.load_state_dict(part)


@register("muon", description="Muon (torch.optim.Muon's update, Moonshot's AdamW-matched RMS, batched per shape) "
                              "for the blocks' matrices, AdamW for the embedding, LM head and norm gains",
          shards=False)
def build(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> MuonAdamW:
    from training.config import ConfigError

    matrices, rest = hidden_matrices(model, params)
    if not matrices:
        raise ConfigError(f"--optimizer muon optimizes the matrices of the model's blocks; {type(model).__name__} "
                          "has no 2-D parameter under `blocks.`")
    wd = s.config.weight_decay
    muon = GroupedMuon(matrices, lr=s.lr, weight_decay=wd)
    adamw = AdamW(param_groups(model, rest, s), lr=s.lr, betas=BETAS, eps=EPS, fused=s.device.type == "cuda",
                  capturable=s.capturable)
    return MuonAdamW(muon, adamw)
