"""CUDA memory snapshots (`torch.cuda.memory._record_memory_history`), viewable at https://pytorch.org/memory_viz."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch

VIEWER_URL = "https://pytorch.org/memory_viz"


def snapshot_unavailable(device: torch.device | str) -> Optional[str]:
    """Why a snapshot cannot be taken on `device`, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return (
            f"--memory-snapshot needs a CUDA device; this run uses {device.type!r} "
            "(torch.cuda.memory records only CUDA caching-allocator events)"
        )
    if not torch.cuda.is_available():
        return "--memory-snapshot needs a CUDA device; torch.cuda.is_available() is False"
    return None


@contextlib.contextmanager
def record_memory_history(path: str | Path, max_entries: int = 100_000) -> Iterator[Path]:
    """Record every CUDA allocation (with stack traces) inside the block, then dump a pickle snapshot to `path`."""
    reason = snapshot_unavailable("cuda")
    if reason:
        raise RuntimeError(reason)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield path
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
