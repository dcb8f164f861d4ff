"""Files that survive a crash at any moment: written under a temporary name, fsynced, renamed into place.

A temporary file is named `.<name>.tmp-<pid>-<random>` next to its target: hidden, unique across processes and
hosts sharing a file system, and recognisable, so that the leftovers of a killed write can be removed later by the
one process that owns the directory (remove_leftovers).
"""

from __future__ import annotations

import os
import shutil
import secrets
from pathlib import Path
from typing import BinaryIO, Callable

TEMP_MARK = ".tmp-"


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to `path`; no other process or host picks the same one."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and TEMP_MARK in path.name


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (the new directory entry reaches the disk)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(tmp: Path, path: Path) -> None:
    """Fsync `tmp` (a temporary file another writer filled, e.g. torch.profiler), rename it to `path`, and make the
    rename durable; on an error `tmp` is removed and `path` untouched."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(f) on a temporary file, fsync it and rename it to `path`: a crash leaves the old file or the new.

    On an error the temporary file is removed and the error propagates; `path` is untouched.
    """
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            write(f)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    move_into_place(tmp, path)


def remove_leftovers(directory: Path) -> list[tuple[Path, int]]:
    """Delete the temporary files (and directories) of writes that were killed half-way; returns (path, bytes) of
    each.

    Only for a directory this process owns (its run lock is held): a live writer's temporary file would go too.
    """
    removed = []
    for p in sorted(directory.glob(f".*{TEMP_MARK}*")):
        if p.is_symlink():
            continue
        if p.is_file():
            size = p.stat().st_size
            p.unlink(missing_ok=True)
        elif p.is_dir():
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
        else:
            continue
        removed.append((p, size))
    return removed
