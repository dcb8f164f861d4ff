"""Checkpoint files for tests: earlier versions' pickled checkpoints, crafted ones that would run code, damaged and
non-finite ones."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.checkpoint import files as checkpoint_files
from training.checkpoint import format as checkpoint


def tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file: name -> (start, end) from the file's start."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return {name: (8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


def flip_bytes(path: Path, tensor: str, count: int = 3) -> None:
    """Flip `count` bytes in the middle of `tensor`'s data (as the file names it: "/model/embed.weight"); the file's
    size and header stay as they were."""
    start, end = tensor_offsets(path)[tensor]
    data = bytearray(path.read_bytes())
    middle = (start + end) // 2
    for i in range(middle, min(middle + count, end)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def with_nonfinite_weight(path: Path, name: str = "embed.weight", value: float = float("nan")) -> None:
    """Rewrite the checkpoint `path` (format.save: whole, its checksums right) with one weight of `name` set to
    `value`."""
    state = checkpoint_files.load_file(path)
    state["model"] = {k: v.clone() for k, v in state["model"].items()}  # off the file's memory map, which goes
    state["model"][name].view(-1)[0] = value
    checkpoint.save(state, path)


def by_index(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name as torch's own state_dict keys it: by position over the groups
    (the order of their "params" lists), as earlier versions saved it."""
    order = [name for group in optimizer["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[name]: s for name, s in optimizer["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer["param_groups"]]}


def legacy_rng_state(rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """The RNG states as earlier versions pickled them, NumPy's and Python's as their own objects: those of now, or
    `rng` (format.rng_state()'s JSON form) converted."""
    if rng is None:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    version, internal, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    return {"python": (version, tuple(internal), gauss),
            "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached), "torch": rng["torch"].clone()}


def write_legacy(state: dict[str, Any], out: Path, args: dict[str, Any] | None = None,
                 attn: str = "sdpa") -> Path:
    """`state` (as this version loads it) written as an earlier version wrote it: torch.save of a dict with
    "model_config" (with the switches since retired, and the attention backend) and "args" for "config", the
    optimizer state keyed by index, and the RNG states pickled, as `<out>/checkpoint-<step>.pt`. It loads only with
    allow_pickle (its NumPy RNG state does not unpickle safely)."""
    state = dict(state)
    config = state.pop("config")
    legacy = {**state, "model_config": {**config["model"], "attn": attn, "fp32_weight_grads": True,
                                        "fused_rope": True, "fp32_residual": False, "fused_gate_up": True},
              "args": args or {}, "rng": legacy_rng_state(state.get("rng"))}
    if "optimizer" in state:
        legacy["optimizer"] = by_index(state["optimizer"])
    legacy["model"] = {k: v.clone() for k, v in state["model"].items()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"checkpoint-{state['step']}.pt"
    torch.save(legacy, path)
    return path


MARKER = "code-ran"


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


class RunsCode:
    """Unpickling this creates a marker file: what a crafted checkpoint could do with any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


def crafted_pickle(path: Path, marker: Path, state: dict[str, Any] | None = None) -> Path:
    """`path` as torch.save writes a checkpoint (`state`, or a small one), with a payload whose unpickling creates
    `marker`."""
    state = dict(state or {"step": 3, "model": {"w": torch.zeros(2)}})
    state["payload"] = RunsCode(marker)
    torch.save(state, path)
    return path
