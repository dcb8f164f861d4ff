"""`metrics.jsonl`: one JSON object per logged step, appended; safe against kills and a full disk.

- Rows are appended with one write each; a write that fails (a full disk) is taken back, so the file never keeps
  half a row, and MetricsError names the file.
- A torn last line (a kill in the middle of a write, on a file system that tears writes) is ignored with a warning
  naming the file; a bad line anywhere else is an error naming the file and the line.
- On resume, the rows past the checkpoint's step are cut by writing a new file and renaming it over the old one:
  a kill at any moment leaves the old file or the new one, never an empty one.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from training.run.files import write_atomic

METRICS_FILE = "metrics.jsonl"


class MetricsError(RuntimeError):
    """metrics.jsonl cannot be read or written; the one-line message names the file."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_rows(path: Path, warn: Callable[[str], None] = _stderr) -> list[dict[str, Any]]:
    """The rows of a metrics file; [] if it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:  # json's errors and UnicodeDecodeError alike
            if i == last:
                warn(f"warning: {path}: ignoring its torn last line (an interrupted write)")
                continue
            raise MetricsError(f"{path} line {i + 1} is not JSON ({e}); repair or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsError(f"{path} line {i + 1} is not a metrics row (no integer \"step\")")
        rows.append(row)
    return rows


def cut_after(path: Path, step: int, warn: Callable[[str], None] = _stderr) -> int:
    """Keep the rows of steps <= `step` (the checkpoint a run resumes from), atomically; returns how many."""
    if not path.exists():
        return 0
    rows = [r for r in read_rows(path, warn) if r["step"] <= step]
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    try:
        write_atomic(path, lambda f: f.write(text))
    except OSError as e:
        raise MetricsError(f"cannot rewrite {path}: {e.strerror}") from None
    return len(rows)


class MetricsFile:
    """Appends rows to a metrics file (append=False starts it empty)."""

    def __init__(self, path: Path, append: bool = True):
        self.path = path
        try:
            # Unbuffered: each row is one write() of its own, which a failure can take back whole.
            self._file: Optional[Any] = open(path, "ab" if append else "wb", buffering=0)
        except OSError as e:
            raise MetricsError(f"cannot write {path}: {e.strerror}") from None

    def write(self, row: dict[str, Any]) -> None:
        assert self._file is not None, "the metrics file is closed"
        data = (json.dumps(row) + "\n").encode()
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError as e:
            try:
                os.ftruncate(fd, size)  # no half row left behind; freeing space never needs space
            except OSError:
                pass
            raise MetricsError(f"cannot write {self.path}: {e.strerror}") from None

    def sync(self) -> None:
        """Make the rows written so far durable: before a checkpoint, which must not outlive the rows it covers."""
        if self._file is not None:
            try:
                os.fsync(self._file.fileno())
            except OSError as e:
                if e.errno == errno.EINVAL:  # not a file that can be synced (a pipe, a device)
                    return
                raise MetricsError(f"cannot write {self.path}: {e.strerror}") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

