"""A torch.profiler run over a few steps: a Chrome trace plus a table of the top kernels (or CPU ops)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from training.run.files import move_into_place, temp_path, write_atomic


@dataclass(frozen=True)
class KernelRow:
    """One line of the kernel table: a GPU kernel (CUDA) or an operator's self CPU time (CPU)."""

    name: str
    calls: int
    total_ms: float
    percent: float  # of all GPU kernel time (CUDA) or of all self CPU time (CPU) in the active steps


@dataclass(frozen=True)
class ProfileResult:
    trace_path: Path
    table_path: Path
    rows: list[KernelRow]  # every kernel / op, largest total first
    on_gpu: bool
    active_steps: int


def kernel_table(events, on_gpu: bool) -> list[KernelRow]:
    """Rows from `prof.key_averages()`: CUDA kernels by device time, or CPU ops by self CPU time."""
    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    picked = []
    for e in events:
        # User ranges (ProfilerStep#, record_function) would double count the kernels inside them.
        if getattr(e, "is_user_annotation", False) or e.key.startswith("ProfilerStep#"):
            continue
        if e.device_type != wanted:
            continue
        # torch < 2.4 spells it self_cuda_time_total; times are in microseconds.
        us = getattr(e, "self_device_time_total", None) if on_gpu else e.self_cpu_time_total
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            picked.append((e.key, e.count, us))
    total_us = sum(us for _, _, us in picked) or 1.0
    picked.sort(key=lambda r: r[2], reverse=True)
    return [KernelRow(name, calls, us / 1e3, 100.0 * us / total_us) for name, calls, us in picked]


def _short(name: str, width: int = 90) -> str:
    # Triton/CUTLASS kernel names run to hundreds of characters of template arguments.
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_markdown(rows: list[KernelRow], on_gpu: bool, active_steps: int, top: int = 30, title: str = "",
                    split: Optional["GpuTimeSplit"] = None) -> str:
    """The top `top` rows as a markdown table, then the split of the GPU's time when given."""
    what = "GPU kernels by total GPU time" if on_gpu else "CPU ops by self CPU time"
    share = "% of GPU time" if on_gpu else "% of CPU time"
    total_ms = sum(r.total_ms for r in rows)
    lines = []
    if title:
        lines += [f"## {title}", ""]
    lines += [
        f"Top {min(top, len(rows))} of {len(rows)} {what}, over {active_steps} profiled steps "
        f"({total_ms:.2f} ms in all, {total_ms / max(active_steps, 1):.2f} ms per step).",
        "",
        f"| name | calls | total ms | {share} |",
        "|---|---:|---:|---:|",
    ]
    for r in rows[:top]:
        lines.append(f"| `{_short(r.name)}` | {r.calls} | {r.total_ms:.3f} | {r.percent:.1f} |")
    if split is not None:
        lines += ["", f"{split}."]
    return "\n".join(lines) + "\n"


# NCCL's kernels (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...): the GPU side of DDP's and FSDP's collectives.
COMMUNICATION = re.compile(r"nccl", re.I)
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # Chrome-trace categories of what runs on the GPU


@dataclass(frozen=True)
class GpuTimeSplit:
    """How one GPU spent the profiled steps, in ms per step. The span runs from the first GPU operation's start to the
    last one's end; `computing` is the time some kernel other than communication ran (copies and memsets count),
    `communicating` the time some communication kernel ran, `exposed` the part of it with nothing computing beside
    it, `idle` the time nothing ran (the GPU waiting for the host)."""

    span_ms: float
    computing_ms: float
    communicating_ms: float
    exposed_ms: float
    idle_ms: float

    def __str__(self) -> str:
        return (f"GPU time per step {self.span_ms:.2f} ms: computing {self.computing_ms:.2f}, communicating "
                f"{self.communicating_ms:.2f} ({self.exposed_ms:.2f} of it with nothing computing), idle "
                f"{self.idle_ms:.2f}")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def gpu_time_split(events: list[dict], steps: int) -> Optional[GpuTimeSplit]:
    """The GpuTimeSplit of a torch.profiler Chrome trace's events (times in µs) over `steps` steps; None when the
    trace holds no GPU work (a CPU run)."""
    computing, communicating = [], []
    for e in events:
        if e.get("cat") in GPU_WORK and "dur" in e:
            interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            (communicating if COMMUNICATION.search(e.get("name", "")) else computing).append(interval)
    if not computing and not communicating:
        return None
    busy, comp, comm = _union(computing + communicating), _union(computing), _union(communicating)
    span = busy[-1][1] - busy[0][0]
    per_step = 1e3 * steps  # µs over all steps -> ms per step
    return GpuTimeSplit(span / per_step, _length(comp) / per_step, _length(comm) / per_step,
                        (_length(busy) - _length(comp)) / per_step, (span - _length(busy)) / per_step)


def profile_steps(
    step: Callable[[], object],
    out_dir: str | Path,
    device: torch.device | str,
    wait: int = 1,
    warmup: int = 2,
    active: int = 3,
    top: int = 30,
    title: str = "",
) -> ProfileResult:
    """Run `step` wait + warmup + active times under torch.profiler; write trace.json and kernels.md in out_dir."""
    if min(wait, warmup) < 0 or active < 1:
        raise ValueError(f"need wait, warmup >= 0 and active >= 1, got {wait}, {warmup}, {active}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    trace_path, table_path = out_dir / "trace.json", out_dir / "kernels.md"
    captured: dict[str, list[KernelRow]] = {}

    def on_ready(prof) -> None:
        captured["rows"] = write_profile(prof, trace_path, table_path, on_gpu, active, top, title)[0]

    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=on_ready,
    ) as prof:
        for _ in range(wait + warmup + active):
            step()
            if on_gpu:
                torch.cuda.synchronize(device)  # the step's kernels land in its own profiler window
            prof.step()
    return ProfileResult(trace_path, table_path, captured["rows"], on_gpu, active)


def write_profile(prof: profile, trace_path: Path, table_path: Path, on_gpu: bool, steps: int, top: int = 30,
                  title: str = "") -> tuple[list[KernelRow], Optional[GpuTimeSplit]]:
    """Write a stopped profiler's Chrome trace and its kernel table (with the split of the GPU's time on a GPU), each
    moved into place; returns the table's rows and the split."""
    export_trace(prof, trace_path)
    rows = kernel_table(prof.key_averages(), on_gpu)
    split = gpu_time_split(json.loads(trace_path.read_text())["traceEvents"], steps) if on_gpu else None
    table = kernel_markdown(rows, on_gpu, steps, top, title, split)
    write_atomic(table_path, lambda f: f.write(table.encode()))
    return rows, split


def export_trace(prof: profile, path: Path) -> None:
    """The profiler's Chrome trace, written to a temporary name and moved into place."""
    tmp = temp_path(path)
    prof.export_chrome_trace(str(tmp))
    move_into_place(tmp, path)
