"""CUDA memory snapshots (`torch.cuda.memory._record_memory_history`), viewable at https://pytorch.org/memory_viz.

`python -m profiling.memory_snapshot FILE` prints what was live at the snapshot's peak, grouped by the line that
allocated it.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

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
    """Record every CUDA allocation (with Python stacks) inside the block, then dump a pickle snapshot to `path`."""
    reason = snapshot_unavailable("cuda")
    if reason:
        raise RuntimeError(reason)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Python stacks only: C++ frames ("all") take minutes to symbolise when the snapshot is dumped.
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield path
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


# ----------------------------------------------------------------------------------------------------------
# What is live at the peak: the question a snapshot is usually taken to answer, without the browser viewer.
# ----------------------------------------------------------------------------------------------------------

# Frames inside these are plumbing (torch itself, the interpreter): a block is attributed to the innermost frame
# outside them, e.g. the model line or, for compiled code, the line of Inductor's generated `call`.
_PLUMBING = ("/torch/", "<frozen ", "/contextlib.py", "/threading.py")


@dataclass(frozen=True)
class PeakGroup:
    where: str  # innermost non-plumbing frame, "file:line function", and the first frame of the caller's code
    size: int  # bytes of each block
    count: int

    @property
    def bytes(self) -> int:
        return self.size * self.count


@dataclass(frozen=True)
class PeakReport:
    peak_bytes: int  # allocated bytes at the highest point of the recorded window
    before_bytes: int  # of those, allocated before recording began (no stack: parameters, optimizer state, ...)
    groups: list[PeakGroup]  # the rest, grouped by where and size, largest first
    events: int  # allocation events recorded


def _describe(frames: list[dict]) -> str:
    def fmt(f: dict) -> str:
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"

    own = [f for f in frames if not any(p in f["filename"] for p in _PLUMBING)]
    if not own:
        return fmt(frames[0]) if frames else "(no Python stack)"
    # Compiled code allocates from a generated module under the Inductor cache; name the caller's frame too.
    caller = next((f for f in own if "torchinductor" not in f["filename"]), None)
    if caller is None or caller is own[0]:
        return fmt(own[0])
    return f"{fmt(own[0])} <- {fmt(caller)}"


def peak_report(snapshot: dict, device: int = 0) -> PeakReport:
    """The allocations live at the peak of `snapshot`'s recorded window on `device` (torch.cuda.memory._snapshot())."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    allocated_at_end = sum(
        b["size"] for s in snapshot.get("segments", []) if s.get("device", device) == device
        for b in s["blocks"] if b["state"] == "active_allocated"
    )
    net = 0
    for e in trace:
        net += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
    before = allocated_at_end - net  # bytes live when the window opened
    # First pass: where the peak is. Second: replay up to it, keeping what is live (a copy at every new high would
    # be quadratic in a forward pass, where nearly every allocation is one).
    total = peak = before
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] in ("alloc", "free_completed"):
            total += e["size"] if e["action"] == "alloc" else -e["size"]
            if total > peak:
                peak, peak_at = total, i
    live: dict[int, tuple[int, str]] = {}  # addr -> (size, where), for blocks allocated inside the window
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _describe(e.get("frames", [])))
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is None:
            before -= e["size"]  # a block from before the window
    counts: dict[tuple[str, int], int] = {}
    for size, where in live.values():
        counts[(where, size)] = counts.get((where, size), 0) + 1
    groups = sorted((PeakGroup(w, s, c) for (w, s), c in counts.items()), key=lambda g: -g.bytes)
    return PeakReport(peak, before, groups, sum(e["action"] == "alloc" for e in trace))


def format_peak(report: PeakReport, top: int = 20) -> str:
    """A table of the largest groups live at the peak."""
    mib = 2**20
    lines = [f"peak allocated in the window: {report.peak_bytes / mib:,.1f} MiB ({report.events} allocations recorded)",
             f"{report.before_bytes / mib:12,.1f} MiB  allocated before recording (parameters, optimizer state, ...)"]
    for g in report.groups[:top]:
        lines.append(f"{g.bytes / mib:12,.1f} MiB  {g.count:4d} x {g.size / mib:9.2f} MiB  {g.where}")
    rest = report.groups[top:]
    if rest:
        lines.append(f"{sum(g.bytes for g in rest) / mib:12,.1f} MiB  in {len(rest)} smaller groups")
    return "\n".join(lines)


class _SnapshotUnpickler(pickle.Unpickler):
    """A snapshot is plain dicts, lists, strings and numbers: any class in the file (code a crafted one would run) is
    refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a memory snapshot may not refer to {module}.{name}")


def load_snapshot(path: Path) -> dict:
    """A memory snapshot pickle, read without running anything it could carry."""
    with path.open("rb") as f:
        return _SnapshotUnpickler(f).load()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="What was live at the peak of a CUDA memory snapshot pickle.")
    parser.add_argument("snapshot", type=Path,
                        help="a pickle from --memory-snapshot or torch.cuda.memory._dump_snapshot")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--top", type=int, default=20, help="groups to list (default 20)")
    args = parser.parse_args(argv)
    if not args.snapshot.is_file():
        parser.error(f"no snapshot file at {args.snapshot}")
    try:
        snapshot = load_snapshot(args.snapshot)
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        parser.error(f"{args.snapshot} is not a memory snapshot: {e}")
    print(format_peak(peak_report(snapshot, args.device), args.top))


if __name__ == "__main__":
    main()
