"""Named recipes: configuration overlays by name, as a `--config` JSON file holds them.

A recipe is some sections of the configuration tree (training/config.py): `train.py --config muon` starts from the
defaults, applies the recipe, then the flags given, exactly as `--config FILE` does with a file's sections.
`bench_model.py --mode time-to-quality --recipes adamw,muon` trains each on the same model, data and seed for the
same wall-clock budget (benchmarking/quality.py). A recipe is kept only as far as it is measured: see each
description, and docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str  # one line: what it is, and how far its settings are measured
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # {section: {field: value}}


# The learning rate of `muon`: on the CPU sweep of docs/training.md (Recipes: a 4-layer model of width 128 on the
# built-in corpus, 300 steps) Muon's best learning rate was twice AdamW's best (9.6e-3 against 4.8e-3, both far
# above the defaults, as a model that small likes); the recipe keeps that ratio over the default AdamW learning rate,
# which is tuned for `small`. On an H200 (`small`, docs/training.md) twice that rate ended worse with `muon`, and half
# of it worse with the speedrun's model changes.
MUON_LR = 1.2e-3

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("adamw", "the defaults: AdamW with fp32 moments, lr 6e-4, warm-up and cosine decay to 6e-5",
           {"optim": {"optimizer": "adamw"}}),
    Recipe("muon", f"Muon for the blocks' matrices, AdamW for the rest (training/optim/muon.py), lr {MUON_LR:g} "
                   "(2x adamw's, from a CPU sweep)",
           {"optim": {"optimizer": "muon", "lr": MUON_LR}}),
    Recipe("speedrun", "muon plus the architecture changes that paid in the time-to-quality benchmark (docs/training.md): "
                       "QK-norm, the ReLU² MLP, zero-initialised residual projections, windows of 256 in three "
                       "layers of four, logits soft-capped at 15, the embedding's learning rate 10x",
           {"optim": {"optimizer": "muon", "lr": MUON_LR, "embed_lr_scale": 10.0},
            "model": {"qk_norm": True, "mlp": "relu2", "zero_init_residual": True, "window": 256,
                      "window_pattern": "LLLG", "logit_softcap": 15.0}}),
)}


def recipe_names() -> list[str]:
    return list(RECIPES)


def recipe_sections(name: str) -> dict[str, dict[str, Any]]:
    """The sections recipe `name` sets (a copy: the caller may change it)."""
    return {section: dict(values) for section, values in RECIPES[name].sections.items()}


def recipes_help() -> str:
    """The recipes, one line each, for --help."""
    width = max(map(len, RECIPES))
    return "\n".join(f"  {r.name:<{width}}  {r.description}" for r in RECIPES.values())
