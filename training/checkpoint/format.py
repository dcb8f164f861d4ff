"""The checkpoint file: tensors in safetensors, everything else as JSON in its header, a checksum per tensor.

Opening a checkpoint runs no code: safetensors holds raw tensors, and the rest (step, configuration, optimizer
hyper-parameters, gradient scaler, RNG states) is JSON. Each tensor's CRC-32 is written with it and checked when
it is read, so a file damaged on disk is named at load instead of training on; the model's weights are checked to
be finite too. A checkpoint of an earlier version (torch.save's pickle) loads only with `allow_pickle`, since
unpickling a file can run code it carries.

    state = {"model": state_dict, "optimizer": {"state": {name: {key: tensor or number}}, "param_groups": [...]},
             "scaler": {...}, "step": int, "rng": rng_state(), "config": {...}}
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from training.run.files import fsync_dir, temp_path

FORMAT = "flash-lm checkpoint 2"
META_KEY = "flash_lm"
LEGACY_NAME = "checkpoint.pt"  # the single checkpoint of the earliest versions


class CheckpointFormatError(ValueError):
    """A file that is not a whole checkpoint of this trainer; the message says what is wrong with it."""


def rng_state() -> dict[str, Any]:
    """The RNG states of Python, NumPy and torch (and CUDA once it is in use), as JSON values and tensors."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    # Only once CUDA is in use: asking a run on the CPU for the CUDA RNG states would start CUDA for nothing (a GPU
    # context per process, and an error in a process forked from one that had started it).
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by flat name, the JSON rest with each tensor's place replaced by its name)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().to("cpu").contiguous()
            return {"__tensor__": name}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{name}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{name}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a checkpoint holds tensors and JSON values, not {type(value).__name__} (at {name})")

    return tensors, walk(state, "")


def _join(rest: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(rest, dict):
        if set(rest) == {"__tensor__"}:
            return tensors[rest["__tensor__"]]
        return {k: _join(v, tensors) for k, v in rest.items()}
    if isinstance(rest, list):
        return [_join(v, tensors) for v in rest]
    return rest


def checksum(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.reshape(-1).contiguous().view(torch.uint8).numpy()) if t.numel() else 0:08x}"


def save(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` atomically (a temporary file, fsynced, then renamed): a crash leaves the old file or
    the new one."""
    from safetensors.torch import save_file

    tensors, rest = _split(state)
    meta = {"format": FORMAT, "state": rest, "checksums": {k: checksum(t) for k, t in tensors.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    # In a temporary directory of our own: safetensors writes through a temporary file of its own naming, which a kill
    # would otherwise leave beside the checkpoints where nothing recognises it.
    tmp_dir = temp_path(path)
    tmp_dir.mkdir()
    try:
        tmp = tmp_dir / path.name
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
        os.chmod(tmp, 0o644)  # as the run's other files: readable by those the run is shared with
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    fsync_dir(path.parent)


def load(path: Path) -> dict[str, Any]:
    """The state saved in `path`, its checksums and finite weights checked; CheckpointFormatError says what is
    wrong (safetensors' own errors for a torn or foreign file)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
    if META_KEY not in header:
        raise CheckpointFormatError("not a checkpoint of this trainer (no flash_lm header)")
    meta = json.loads(header[META_KEY])
    if meta.get("format") != FORMAT:
        raise CheckpointFormatError(f"written in format {meta.get('format')!r}, this version reads {FORMAT!r}")
    tensors = load_file(str(path))
    for name, expected in meta["checksums"].items():
        if name not in tensors or checksum(tensors[name]) != expected:
            raise CheckpointFormatError(f"tensor {name.lstrip('/')} does not match its checksum (the file is damaged)")
    state = _join(meta["state"], tensors)
    bad = nonfinite(state.get("model", {}))
    if bad:
        raise CheckpointFormatError(f"its weights are not finite ({bad})")
    return state


def nonfinite(tensors: dict[str, torch.Tensor]) -> Optional[str]:
    """The name of the first tensor holding a NaN or an infinity, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def load_legacy(path: Path, allow_pickle: bool) -> dict[str, Any]:
    """A checkpoint of an earlier version (torch.save's pickle). Without `allow_pickle`, only what unpickles safely
    (tensors and plain values): its NumPy RNG state does not, so such a file is refused, naming the flag."""
    if allow_pickle:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not re.search(r"unsupported global|GLOBAL .* is blocked|reduce for unrecognized", str(e), re.I):
            raise  # no object refused: a damaged or foreign file, named as it is
        raise CheckpointFormatError("written by an earlier version with pickle, which can run code when loaded; "
                                    "pass --allow-pickle if you trust this file") from None
