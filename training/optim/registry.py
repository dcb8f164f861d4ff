"""Optimizers by name. An optimizer is one module that calls `register`; training/step.py builds it by name.

Every registered optimizer is a `torch.optim.Optimizer` whose `step(clip_coef=None)` first multiplies every gradient by
the 0-dim tensor `clip_coef` when given (the clipping coefficient the step computed from the global norm), or an
object driven the same way (`param_groups`, `step(clip_coef=None)`, `zero_grad`, `state_dict`/`load_state_dict`) that
lists the torch optimizers it combines as `.optimizers`: checkpoints save their state by parameter name through that
list (training/checkpoint/resume.py, muon.py). What an entry declares:
- steps_in_backward: it can step each parameter on its own, as soon as its gradient exists (training/optim/overlapped.py
  then steps it during the backward when nothing needs all gradients first);
- shards: it runs on FSDP's sharded parameters (elementwise updates do; one that needs whole matrices does not);
- keeps_weight_copies: under bf16/fp16 autocast it rewrites the low-precision weight copies the forward reads (not
  under FSDP, whose all-gather casts the weights);
- capturable: its step can be captured in a CUDA graph (it reads its learning rate and step count from device
  tensors, and nothing in it waits for the host); training/config.py leaves the graph off for one that cannot;
- state_layout: what its per-parameter state holds (default: its own name); a checkpoint's optimizer state resumes
  a run whose optimizer has the same layout (adamw-bf16 keeps adamw's moments, in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

BETAS = (0.9, 0.95)
EPS = 1e-8


@dataclass(frozen=True)
class OptimizerSettings:
    """What a builder gets besides the parameters: the run's optimizer section (training.config.OptimConfig), the
    learning rate (a device tensor when a CUDA graph replays the step), and the weight copies to rewrite."""

    config: "OptimConfig"  # noqa: F821 (training.config, imported lazily to keep this module light)
    lr: float | torch.Tensor
    device: torch.device
    capturable: bool = False
    weight_copies: Optional[dict[nn.Parameter, torch.Tensor]] = None


Builder = Callable[[nn.Module, list[nn.Parameter], OptimizerSettings], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Builder  # (model, its parameters to optimize, settings) -> optimizer
    description: str
    steps_in_backward: bool = False
    shards: bool = True
    keeps_weight_copies: bool = False
    capturable: bool = True
    state_layout: str = ""  # "" is the optimizer's own name


_OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register(name: str, *, description: str, steps_in_backward: bool = False, shards: bool = True,
             keeps_weight_copies: bool = False, capturable: bool = True,
             state_layout: Optional[str] = None) -> Callable[[Builder], Builder]:
    """Decorator: register `build(model, params, settings) -> optimizer` under `name`."""

    def decorate(build: Builder) -> Builder:
        _OPTIMIZERS[name] = OptimizerSpec(name, build, description, steps_in_backward, shards, keeps_weight_copies,
                                          capturable, state_layout or name)
        return build

    return decorate


def optimizer_names() -> list[str]:
    return list(_OPTIMIZERS)


def get_optimizer(name: str) -> OptimizerSpec:
    if name not in _OPTIMIZERS:
        raise KeyError(f"unknown optimizer {name!r}; valid: {', '.join(_OPTIMIZERS)}")
    return _OPTIMIZERS[name]


def state_layout(name: str) -> str:
    """The state layout of optimizer `name`; a name no longer registered is its own layout."""
    return _OPTIMIZERS[name].state_layout if name in _OPTIMIZERS else name


def param_groups(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> list[dict]:
    """The groups over `params`: weight decay on matrices only (norm gains are scales, and decaying them towards 0
    fights the normalisation); with --embed-lr-scale, the embedding in a group of its own at that multiple of the
    learning rate and with its decay divided by as much, so that the shrinkage a step (lr x decay) stays the run's."""
    wd, scale = s.config.weight_decay, s.config.embed_lr_scale
    embed = dict(model.named_parameters()).get("embed.weight") if scale != 1 else None
    if scale != 1 and embed is None:
        from training.config import ConfigError
        raise ConfigError(f"--embed-lr-scale: {type(model).__name__} has no parameter named embed.weight")
    scaled = [p for p in params if p is embed]
    rest = [p for p in params if p is not embed]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
              {"params": scaled, "weight_decay": wd / scale, "lr": s.lr * scale, "lr_scale": scale}]
    return [g for g in groups if g["params"]]
