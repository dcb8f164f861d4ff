"""Atomic checkpoint files (a temporary file in the same directory, fsynced, then renamed) and RNG states.

The checkpoints of a run, kept and chosen by step, are training.checkpoint_files'.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.run.files import write_atomic

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    # Only once CUDA is in use: asking a run on the CPU for the CUDA RNG states would start CUDA for nothing (a GPU
    # context per process, and an error in a process forked from one that had started it).
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to `path` so that a crash at any moment leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: torch.save(obj, f))


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint to resume from at {path}")
    # weights_only=False: the checkpoint holds RNG states and the config dict, which we wrote ourselves.
    return torch.load(path, map_location=map_location, weights_only=False)
