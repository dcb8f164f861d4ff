"""A run owns its output directory: a lock against a second run, and no silent replacement of an earlier run.

- The lock is `<out>/.lock`, holding the host, pid and start time of the process that owns the directory; it is
  written in full under a temporary name and hard-linked into place (which fails if a lock exists), so it never
  exists half written, and it is removed when the run ends. A lock left by a process that no longer runs
  on this host (killed with SIGKILL, say) is stale: it is taken over with a message. A lock from another host cannot
  be checked from here; the message says which file to delete if that run is gone.
- A run without --resume into a directory that already holds a run (a checkpoint, or metrics) stops and names
  --resume and --overwrite. --overwrite moves the earlier run aside, to `<out>.old-<UTC time>` next to it: nothing
  is deleted.
- Temporary files left by writes that were killed half-way are removed once the lock is held (training.files).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Optional

from training.parallel import distributed
from training.parallel.distributed import DistContext
from training.run.files import fsync_dir, remove_leftovers, temp_path

LOCK_NAME = ".lock"
CHECKPOINT_PATTERNS = ("checkpoint-*.safetensors", "checkpoint.pt", "checkpoint-*.pt", "checkpoint_dcp")
METRICS_NAME = "metrics.jsonl"


class RunDirError(RuntimeError):
    """The output directory cannot be used; the one-line message names it and says what to do."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_out(out: Path) -> None:
    """--out must be a directory, or a path where one can be created, that this process can write."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RunDirError(f"--out {out} cannot be created: {ancestor} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != out else ""
        raise RunDirError(f"--out {out} cannot be created: {e.strerror}{where}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"--out {out} is not writable (permission denied)")


def _process_start(pid: int) -> Optional[str]:
    """The start time of process `pid` in clock ticks since boot (Linux), telling a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before ')' may hold spaces


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}


class RunLock:
    """The lock of one output directory: `acquire()` or raise RunDirError naming the run that holds it. `path`: the
    lock file, `<out>/.lock` unless given (prepare_data.py locks a directory it has yet to create by a file beside it).
    """

    def __init__(self, out: Path, say: Callable[[str], None] = _stderr, path: Optional[Path] = None):
        self.out = out
        self.path = path or out / LOCK_NAME
        self._say = say
        self._content: Optional[str] = None

    @property
    def held(self) -> bool:
        return self._content is not None

    def acquire(self) -> None:
        content = json.dumps(_this_process()) + "\n"
        for _ in range(10):  # each pass either takes the lock, raises, or removed a stale lock
            # A process killed before the link leaves only its temporary file, which the next owner removes.
            tmp = temp_path(self.path)
            try:
                try:
                    with open(tmp, "x") as f:
                        f.write(content)
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    raise RunDirError(f"--out {self.out} is not writable: {e.strerror}") from None
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    self._take_over_if_stale()
                    continue
                except FileNotFoundError:  # the temporary file removed as a leftover by the run holding the lock
                    continue
                except OSError as e:
                    raise RunDirError(f"--out {self.out}: cannot create the lock {self.path}: {e.strerror}") from None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
            self._content = content
            return
        raise RunDirError(f"{self.out}: could not take the lock {self.path}; other processes keep taking it")

    def _take_over_if_stale(self) -> None:
        """Raise if the lock belongs to a live (or uncheckable) run; otherwise remove it, with a message."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:  # released in the meantime
            return
        try:
            holder = json.loads(text)
            host, pid = str(holder["host"]), int(holder["pid"])
        except (ValueError, KeyError, TypeError):  # never written by a run: a lock appears only complete
            why = "an unreadable lock"
        else:
            if host != socket.gethostname():
                raise RunDirError(f"{self.out} is in use by process {pid} on host {host}, which cannot be checked "
                                  f"from here; if that run is gone, delete {self.path}")
            start = holder.get("start")
            if _running(pid) and (start is None or start == _process_start(pid)):
                raise RunDirError(f"{self.out} is in use by another run (process {pid} on {host}); wait for it to "
                                  "end, or choose another --out")
            why = f"the stale lock of process {pid}, which no longer runs"
        # Move the lock aside under a unique name and check it is the one judged stale: two processes taking over
        # the same stale lock must not remove the fresh lock of whichever came first.
        aside = temp_path(self.path)
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != text:  # a live lock, taken just now: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            return
        aside.unlink()
        self._say(f"{self.out}: removed {why}")

    def release(self) -> None:
        """Remove the lock if this process holds it (and it is still ours)."""
        if self._content is None:
            return
        try:
            if self.path.read_text() == self._content:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._content = None

    def __enter__(self) -> "RunLock":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_files(out: Path) -> list[str]:
    """The names of what marks `out` as holding a run: checkpoints, and metrics with at least one row."""
    found = sorted({p.name for pattern in CHECKPOINT_PATTERNS for p in out.glob(pattern)})
    metrics = out / METRICS_NAME
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_NAME)
    return found


def check_new_run(out: Path, resume: bool, overwrite: bool) -> None:
    """A run without --resume or --overwrite must not replace the run already in `out`."""
    if resume or overwrite:
        return
    found = run_files(out)
    if found:
        listed = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise RunDirError(f"{out} already holds a run ({listed}); continue it with --resume, or start over with "
                          f"--overwrite (moves it to {out}.old-<UTC time>)")


def move_aside(out: Path, now: Optional[datetime] = None) -> Optional[Path]:
    """Move everything in `out` but its lock to a new sibling `<out>.old-<UTC time>`; None if there was no run."""
    if not run_files(out):
        return None
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    dest = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while True:
        try:
            dest.mkdir()
            break
        except FileExistsError:
            n += 1
            dest = out.with_name(f"{out.name}.old-{stamp}-{n}")
    for entry in sorted(out.iterdir()):
        if entry.name != LOCK_NAME:
            os.rename(entry, dest / entry.name)
    return dest


def claim(out: Path, resume: bool, overwrite: bool, say: Callable[[str], None] = _stderr) -> RunLock:
    """Check --out, take its lock and refuse to replace a run in it; returns the held lock. Changes nothing else.

    On an error, the lock is released again and RunDirError raised.
    """
    check_out(out)
    lock = RunLock(out, say)
    lock.acquire()
    try:
        check_new_run(out, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


@contextlib.contextmanager
def owned(out: Path, resume: bool, overwrite: bool, ctx: DistContext) -> Iterator[None]:
    """Rank 0 holds --out's lock for the whole run (`claim`); every rank stops if it cannot take it. The directories
    the claim created (--out and any missing parent) are removed again if the run fails before writing anything into
    them."""
    lock, error = None, None
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    if ctx.is_main:
        try:
            lock = claim(out, resume, overwrite)
        except RunDirError as e:
            error = e
    if distributed.any_rank(error is not None, ctx):
        raise error or RunDirError(f"rank 0 could not take {out}; its message says why")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
            for path in created:
                with contextlib.suppress(OSError):
                    path.rmdir()  # only if empty: a run that wrote nothing leaves nothing


def prepare(out: Path, overwrite: bool, say: Callable[[str], None] = _stderr) -> None:
    """With the lock held and the inputs checked: move an earlier run aside (--overwrite) and remove the
    temporary files of writes that were killed."""
    if overwrite:
        dest = move_aside(out)
        if dest is not None:
            say(f"--overwrite: moved the earlier run in {out} to {dest}")
    removed = remove_leftovers(out)
    if removed:
        size = sum(size for _, size in removed)
        amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 // 10 else f"{size / 2**10:.1f} KiB"
        say(f"{out}: removed {len(removed)} temporary file{'s' * (len(removed) > 1)} left by an interrupted write "
            f"({amount})")
