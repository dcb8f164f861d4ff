"""Sharded checkpoints of FSDP runs: torch.distributed.checkpoint (DCP) directories, written atomically.

Layout of `<out>/checkpoint_dcp/`: DCP's `.metadata` and one `__<rank>_0.distcp` shard file per rank holding
{"model": model state dict, "optimizer": optimizer state dict} as returned by
torch.distributed.checkpoint.state_dict.get_state_dict (keyed by parameter names), plus `extras.pt` from rank 0
(step, RNG states, scaler, model config, arguments). Each rank writes only its shards; any number of ranks can
load it back (DCP reshards), and `python -m training.consolidate` turns it into one single-process file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoint import format as checkpoint
from training.parallel.distributed import DistContext, barrier

DCP_DIR_NAME = "checkpoint_dcp"
EXTRAS_FILE = "extras.pt"


def _tmp_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _old_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extras: dict[str, Any],
         ctx: DistContext) -> None:
    """Every rank writes its shards to a temporary directory; rank 0 then swaps it in for `path`.

    A crash at any moment leaves the last complete checkpoint at `path` or, between the two renames, at
    `.<name>.old` next to it, which resolve() falls back to.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, old = _tmp_dir(path), _old_dir(path)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that crashed while saving
    barrier(ctx)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
    if ctx.is_main:
        checkpoint.save_atomic(extras, tmp / EXTRAS_FILE)
    barrier(ctx)  # all shards are on disk
    if ctx.is_main:
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(path.parent)
    barrier(ctx)  # nobody reads or rewrites the directory before the swap is done


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: Path) -> Path:
    """The complete checkpoint directory for `path`: itself, or the previous one if a crash hit between renames."""
    for candidate in (path, _old_dir(path)):
        if (candidate / ".metadata").exists() and (candidate / EXTRAS_FILE).exists():
            return candidate
    raise FileNotFoundError(f"no sharded checkpoint to resume from at {path}")


def exists(path: Path) -> bool:
    """Whether resolve(path) finds a complete checkpoint."""
    try:
        resolve(path)
    except FileNotFoundError:
        return False
    return True


def load_extras(path: Path) -> dict[str, Any]:
    """Step, RNG states, scaler, model config and arguments saved next to the shards."""
    return checkpoint.load(resolve(path) / EXTRAS_FILE)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state into the (sharded) model and its optimizer, each rank reading its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes and shards to fill
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(resolve(path)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_full(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """The whole checkpoint in this one process, without a process group: {"model": ..., "optimizer": ...}.

    `keys` limits what is read (e.g. {"model"}: weights without the optimizer's two moments).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # The same calls as torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which takes no `keys`
    # and writes a file where we want a dict.
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(resolve(path))),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return state
