"""Sharded checkpoints of FSDP runs: torch.distributed.checkpoint (DCP) directories, written atomically.

Layout of `<out>/checkpoint_dcp/`: DCP's `.metadata` and one `__<rank>_0.distcp` shard file per rank holding tensors
only: "model/<name>" for the weights and "optimizer/<name>/<key>" for the optimizer state, keyed by parameter name
(torch.distributed.checkpoint.state_dict). Everything else (step, RNG states, scaler, configuration, the optimizer's
hyper-parameters) is `extras.safetensors` from rank 0, in format.py's file format. Each rank writes only its shards;
any number of ranks can load it back (DCP reshards), and `python -m training.checkpoint.consolidate` turns it into one
single-process file. Reading runs no code: the shards hold tensors, which DCP loads with torch.load(weights_only=True),
and the metadata is unpickled with only DCP's own metadata classes allowed (SafeReader).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoint import format
from training.parallel.distributed import DistContext, barrier
from training.run.files import fsync_dir

DCP_DIR_NAME = "checkpoint_dcp"
EXTRAS_FILE = "extras.safetensors"
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: a class outside it (code a crafted file would run) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a sharded checkpoint's metadata may not refer to {module}.{name}")


def read_metadata(directory: Path) -> Any:
    """DCP's metadata of `directory`, unpickled with _MetadataUnpickler; CheckpointFormatError (one line, naming the
    file) if it refers to anything else or does not unpickle. Checked before DCP reads it: DCP reports a failed read
    as a CheckpointException, a BaseException with every rank's traceback in its text."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - whatever a crafted or damaged file raises, one line names it
        raise format.CheckpointFormatError(f"{path}: {e or type(e).__name__}") from None


def safe_reader(path: Path) -> Any:
    """DCP's FileSystemReader, its metadata read with _MetadataUnpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def split_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer state keyed by parameter name as (its tensors by flat name, the rest as JSON values)."""
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {"state": {}, "param_groups": state["param_groups"]}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{name}/{key}"] = value
            else:
                rest["state"].setdefault(name, {})[key] = value
    return tensors, rest


def join_optimizer(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """split_optimizer's inverse."""
    state: dict[str, dict[str, Any]] = {name: dict(entries) for name, entries in rest["state"].items()}
    for flat, value in tensors.items():
        name, key = flat.removeprefix("optimizer/").rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


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
    optimizer_tensors, optimizer_rest = split_optimizer(optimizer_state)
    dcp.save({"model": model_state, **optimizer_tensors}, checkpoint_id=str(tmp))
    if ctx.is_main:
        format.save({**extras, "optimizer": optimizer_rest}, tmp / EXTRAS_FILE)
    barrier(ctx)  # all shards are on disk
    if ctx.is_main:
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    barrier(ctx)  # nobody reads or rewrites the directory before the swap is done


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
    """Step, RNG states, scaler, configuration and the optimizer's non-tensor state, saved next to the shards (the
    shards' metadata checked first)."""
    directory = resolve(path)
    read_metadata(directory)
    return format.load(directory / EXTRAS_FILE)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state into the (sharded) model and its optimizer, each rank reading its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes and shards to fill
    optimizer_tensors, _ = split_optimizer(optimizer_state)
    state = {"model": model_state, **optimizer_tensors}
    directory = resolve(path)
    read_metadata(directory)
    dcp.load(state, storage_reader=safe_reader(directory))
    rest = format.load(directory / EXTRAS_FILE)["optimizer"]
    loaded = join_optimizer({k: v for k, v in state.items() if k != "model"}, rest)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=loaded)


def load_full(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """The whole checkpoint in this one process, without a process group: {"model": ..., "optimizer": ...}.

    `keys` limits what is read: {"model"} reads the weights without the optimizer's moments.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    directory = resolve(path)
    read_metadata(directory)
    state: dict[str, Any] = {}
    # The same calls as torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which takes no `keys`.
    _load_state_dict(state, storage_reader=safe_reader(directory), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    full = {"model": state["model"]}
    if keys is None or "optimizer" in keys:
        tensors = {k: v for k, v in state.items() if k.startswith("optimizer/")}
        full["optimizer"] = join_optimizer(tensors, format.load(directory / EXTRAS_FILE)["optimizer"])
    return full
