"""FP8 training (`--fp8 tensorwise|rowwise`): the blocks' Linear layers run their three matmuls in float8 through
torchao's float8 training (torchao.float8: e4m3 inputs and weights, e5m2 gradients, scales computed per tensor or per
row on the fly), under bf16 autocast, best compiled.

What changes: each block's q/k/v, output and MLP projections become torchao `Float8Linear`s with the same
weights under the same state-dict keys, so checkpoints and sampling are unchanged. The
embedding (an fp32 lookup) and the LM head (a bf16 matmul under autocast) are not converted: the logits' precision
matters most and the head is one matmul of many.
Layers whose dimensions are not multiples of 16 (float8 matmuls need them) are left as they are. On the CPU, which
has no float8 matmul, torchao emulates it (the same scaling and casts, matmuls in higher precision): what the
tests check the numerics with.

Under FSDP with tensorwise scaling, the weights are all-gathered in float8 (half of bf16's bytes): each weight's
shard casts itself with a scale from the whole weight's absolute maximum, and `precompute_scales` computes all those
maxima in one all-reduce after each optimizer step, as torchtitan does, rather than one per weight in the forward.
Rowwise scales cannot be split over shards: its weights are all-gathered in bf16 and cast in the forward.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from model.layers import Linear

RECIPES = ("off", "tensorwise", "rowwise")


def problem(recipe: str, device: torch.device, precision: str, d_model: int) -> Optional[str]:
    """Why `--fp8 recipe` cannot train here, or None."""
    if recipe == "off":
        return None
    if d_model % 16:  # every Linear of a block reads or writes d_model: none would convert
        return f"--fp8 {recipe} needs a --d-model that is a multiple of 16 (float8 matmuls), got {d_model}"
    if precision != "bf16":
        return f"--fp8 {recipe} trains under bf16 autocast: add --dtype bf16 (got {precision})"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "--fp8 needs torchao: pip install torchao"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"--fp8 needs float8 matmuls (compute capability 8.9 or later: Ada, Hopper); {name} has none"
    return None


def gathers_float8(recipe: str, parallel: str) -> bool:
    """Whether FSDP all-gathers the float8 layers' weights in float8 (tensorwise scaling only)."""
    return recipe == "tensorwise" and parallel == "fsdp"


def convert(model: nn.Module, recipe: str, device: torch.device, float8_all_gather: bool = False) -> list[str]:
    """Swap the blocks' Linear layers of `model` for float8 ones in place; returns the names of those swapped.

    Call it before the optimizer is built, before compiling and before FSDP shards the model. Emulated off CUDA.
    With `float8_all_gather` (gathers_float8) each weight becomes a new Parameter wrapping the same storage in
    torchao's float8-castable tensor, which FSDP then all-gathers in float8; names and values do not change."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=device.type != "cuda",
                                 enable_fsdp_float8_all_gather=float8_all_gather)
    swapped = []
    for name, module in list(model.named_modules()):
        if not name.startswith("blocks.") or not isinstance(module, Linear):
            continue
        d_out, d_in = module.weight.shape
        if d_in % 16 or d_out % 16:
            continue
        plain = nn.Linear(d_in, d_out, bias=False, device="meta")
        plain.weight = module.weight  # the same Parameter (its storage under float8 all-gather): names unchanged
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Float8Linear.from_float(plain, config=config))
        swapped.append(name)
    return swapped


def precompute_scales(model: nn.Module) -> None:
    """The float8 scales of every FSDP-sharded float8 weight of `model`, from their absolute maxima in one
    all-reduce; call it after each optimizer step, so that the next all-gathers cast with the new weights' scales."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
