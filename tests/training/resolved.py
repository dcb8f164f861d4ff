"""Resolved training configurations (training.config.resolve) of a tiny model on the CPU, for tests building a step."""

from __future__ import annotations

from typing import Any

from model import ModelConfig
from training.config import Config, resolve

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=256, context_length=32)


def resolved(model: ModelConfig = TINY, **sections: dict[str, Any]) -> Config:
    """The tiny model on the CPU with SDPA and batches of 4, the given fields replaced per section, resolved."""
    base = Config(model=model).replace(execution={"device": "cpu", "attn": "sdpa"}, data={"batch_size": 4})
    return resolve(base.replace(**sections) if sections else base).config
