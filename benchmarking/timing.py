"""Timing a callable (triton's do_bench on CUDA, perf_counter on CPU) and measuring its memory.

Two timers, for two questions:
- `time_ms(fn, device, ...)`: the median time of one call, for kernels. On CUDA it uses
  `triton.testing.do_bench` (clears L2 between calls, CUDA-event timing), with its time budget set so that
  it runs about `iters` calls; on CPU it takes the median of `iters` `time.perf_counter` readings.
- `time_stats_ms(fn, device, ...)`: mean, std, median, min of `iters` synchronised calls, for training
  steps (bench_model), where each call is long and the spread matters.
Both run `warmup` untimed calls first (compilation, autotuning, allocator warm-up).
`captured(fn, device)` records one call of fn as a CUDA graph and returns its replay: timed with `time_ms`, that is
the GPU time of fn's kernels without the host time of launching them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch

MIB = 1024**2


@dataclass(frozen=True)
class TimingStats:
    """Summary of per-call times in milliseconds."""

    median_ms: float
    mean_ms: float
    std_ms: float  # sample standard deviation; 0.0 for a single call
    min_ms: float
    n: int  # number of timed calls

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Fields as a flat dict, keys prefixed (e.g. prefix='step_' -> 'step_mean_ms')."""
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def summarize(times_ms: Sequence[float]) -> TimingStats:
    """TimingStats of a non-empty list of per-call times in ms."""
    if not times_ms:
        raise ValueError("summarize needs at least one time")
    times = [float(t) for t in times_ms]
    std = statistics.stdev(times) if len(times) > 1 else 0.0
    return TimingStats(statistics.median(times), statistics.fmean(times), std, min(times), len(times))


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on `device` (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_counts(iters: int, warmup: int) -> None:
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _reset_grads(tensors: Optional[Sequence[torch.Tensor]]) -> None:
    for t in tensors or ():
        t.grad = None


def _cpu_times_ms(fn: Callable[[], object], iters: int, warmup: int,
                  grad_to_none: Optional[Sequence[torch.Tensor]]) -> list[float]:
    for _ in range(warmup):
        _reset_grads(grad_to_none)
        fn()
    times = []
    for _ in range(iters):
        _reset_grads(grad_to_none)  # outside the timed region, as do_bench does
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _l2_flush() -> Callable[[], None]:
    """The L2 flush do_bench runs before each call, so our estimate matches its own (no-op if unavailable)."""
    try:
        from triton import runtime

        driver = runtime.driver.active
        cache = driver.get_empty_cache_for_benchmark()
        return lambda: driver.clear_cache(cache)
    except (AttributeError, ImportError):  # older triton: do_bench zeroes its own buffer; close enough
        return lambda: None


def _cuda_estimate_ms(fn: Callable[[], object], device: torch.device, calls: int = 3) -> float:
    """Time per call including an L2 flush, as do_bench estimates it."""
    flush = _l2_flush()
    # Once untimed: the first flush of a process loads its kernel (lazy CUDA module loading), milliseconds that
    # inflated the estimate, so do_bench ran 132 calls where 20 were asked (H100, tests/benchmarking/test_timing.py).
    flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(calls):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return max(start.elapsed_time(end) / calls, 1e-3)


def _cuda_times_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                   grad_to_none: Optional[Sequence[torch.Tensor]]) -> list[float]:
    from triton.testing import do_bench

    with torch.cuda.device(device):
        _reset_grads(grad_to_none)
        fn()  # first call may compile; keep it out of the estimate
        estimate = _cuda_estimate_ms(fn, device)
        _reset_grads(grad_to_none)
        # do_bench takes time budgets (ms), not counts: it runs max(1, budget / its own estimate) calls.
        # Both estimates include the L2 flush, so the count lands near `iters` (noise moves it a little).
        warmup_ms, rep_ms = warmup * estimate, iters * estimate
        try:
            times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all")
        except AssertionError:  # a triton without return_mode="all": median only
            return [do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")]
    return list(times) if isinstance(times, (list, tuple)) else [float(times)]


def time_ms(fn: Callable[[], object], device: torch.device | str, *, iters: int = 100, warmup: int = 10,
            grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> TimingStats:
    """Per-call time of `fn` on `device`; use `.median_ms` as the figure for kernels.

    `grad_to_none`: tensors whose `.grad` is set to None before each call, so a backward pass does not
    time gradient accumulation.
    """
    _check_counts(iters, warmup)
    device = torch.device(device)
    if device.type == "cuda":
        return summarize(_cuda_times_ms(fn, device, iters, warmup, grad_to_none))
    return summarize(_cpu_times_ms(fn, iters, warmup, grad_to_none))


def time_stats_ms(fn: Callable[[], object], device: torch.device | str, *, iters: int = 10, warmup: int = 2,
                  grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> TimingStats:
    """Mean/std/median of `iters` calls, each synchronised and timed with perf_counter (no L2 flush).

    For long calls such as whole training steps: every call is timed on its own, so `std_ms` is the real
    call-to-call spread (do_bench's events would hide host-side stalls between calls).
    """
    _check_counts(iters, warmup)
    device = torch.device(device)
    for _ in range(warmup):
        _reset_grads(grad_to_none)
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        _reset_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return summarize(times)


def captured(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 3,
             grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> Callable[[], None]:
    """One call of `fn` recorded as a CUDA graph; returns the graph's replay (which runs the same kernels on the
    same memory). `warmup` eager calls on a side stream come first, so nothing compiles or autotunes during the
    capture. `grad_to_none` are unset before each call and before the capture, so the captured backward writes
    fresh gradients (in the graph's memory pool) rather than accumulating."""
    device = torch.device(device)
    if not is_cuda(device):
        raise ValueError(f"a CUDA graph needs a CUDA device, got {device}")
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                _reset_grads(grad_to_none)
                fn()
        torch.cuda.current_stream().wait_stream(side)
        _reset_grads(grad_to_none)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


# --- memory -------------------------------------------------------------------------------------------


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window on `device` (no-op off CUDA)."""
    if is_cuda(device):
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocated_bytes(device: torch.device | str) -> Optional[int]:
    """Bytes held by live tensors on `device` now; None off CUDA (no allocator statistics)."""
    if not is_cuda(device):
        return None
    synchronize(device)
    return torch.cuda.memory_allocated(device)


def peak_allocated_bytes(device: torch.device | str) -> Optional[int]:
    """Most bytes held by live tensors since the last `reset_peak_memory`; None off CUDA."""
    if not is_cuda(device):
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def to_mib(nbytes: Optional[float]) -> Optional[float]:
    """Bytes -> MiB, passing None through."""
    return None if nbytes is None else nbytes / MIB


def tflops(flop: float, ms: Optional[float]) -> Optional[float]:
    """TFLOP/s of `flop` operations done in `ms` milliseconds; None when the time is missing or not positive."""
    if ms is None or not math.isfinite(ms) or ms <= 0:
        return None
    return flop / (ms * 1e-3) / 1e12
