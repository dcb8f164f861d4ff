"""FP8 training (`--fp8 tensorwise|rowwise`): the blocks' Linear layers run their three matmuls in float8 through
torchao's float8 training (torchao.float8: e4m3 inputs and weights, e5m2 gradients, scales computed per tensor or per
row on the fly), under bf16 autocast, best compiled.

What changes: each block's q/k/v, output and SwiGLU projections become torchao `Float8Linear`s that share the
original weight Parameters, so the optimizer, checkpoints (the same state-dict keys) and sampling are unchanged. The
embedding (an fp32 lookup) and the LM head (a bf16 matmul under autocast) are not converted: the logits' precision
matters most and the head is one matmul of many.
Layers whose dimensions are not multiples of 16 (float8 matmuls need them) are left as they are. On the CPU, which
has no float8 matmul, torchao emulates it (the same scaling and casts, matmuls in higher precision): what the
tests check the numerics with.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from model.layers import Linear

RECIPES = ("off", "tensorwise", "rowwise")


def problem(recipe: str, device: torch.device, precision: str, parallel: str, d_model: int) -> Optional[str]:
    """Why `--fp8 recipe` cannot train here, or None."""
    if recipe == "off":
        return None
    if d_model % 16:  # every Linear of a block reads or writes d_model: none would convert
        return f"--fp8 {recipe} needs a --d-model that is a multiple of 16 (float8 matmuls), got {d_model}"
    if precision != "bf16":
        return f"--fp8 {recipe} trains under bf16 autocast: add --dtype bf16 (got {precision})"
    if parallel == "fsdp":
        return "--fp8 with --parallel fsdp is not supported (its float8 all-gather is not wired up here)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "--fp8 needs torchao: pip install torchao"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"--fp8 needs float8 matmuls (compute capability 8.9 or later: Ada, Hopper); {name} has none"
    return None


def convert(model: nn.Module, recipe: str, device: torch.device) -> list[str]:
    """Swap the blocks' Linear layers of `model` for float8 ones in place; returns the names of those swapped.

    Call it before the optimizer is built and before compiling. Emulated off CUDA."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    swapped = []
    for name, module in list(model.named_modules()):
        if not name.startswith("blocks.") or not isinstance(module, Linear):
            continue
        d_out, d_in = module.weight.shape
        if d_in % 16 or d_out % 16:
            continue
        plain = nn.Linear(d_in, d_out, bias=False, device="meta")
        plain.weight = module.weight  # the same Parameter: the optimizer and the state dict see no change
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Float8Linear.from_float(plain, config=config))
        swapped.append(name)
    return swapped
