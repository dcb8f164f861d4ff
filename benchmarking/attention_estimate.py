"""How long an attention sweep takes on the CPU, roughly: enough to tell a sweep of minutes from one of days before
it starts.

From FLOP counts (AttentionPoint.flop) and rates measured on two x86 cores (torch 2.13, triton 3.9): `flash` in the
Triton interpreter runs about 30 MFLOP/s plus ~0.3 s a launch (seq 1024, 2 heads, d 64: 7 s a forward); the PyTorch
backends about 20 GFLOP/s (sdpa 70 at seq 8192-32768, naive less); torch.compile'd backends compile each shape
once, for about a minute. A loaded machine is slower, a bigger one faster: only the order of magnitude is meant.
"""

from __future__ import annotations

from typing import Sequence

from benchmarking.attention_point import AttentionPoint

INTERPRETED = {"flash"}  # their kernels run in the Triton interpreter on the CPU
COMPILED = {"compiled", "flex"}  # torch.compile'd: a compile per shape
FORWARD_ONLY_ON_CPU = {"flex"}  # no backward on the CPU (timed forward-only)
INTERPRETER_FLOPS, INTERPRETER_LAUNCH_S = 3e7, 0.3
TORCH_FLOPS = 2e10
COMPILE_S = 60.0


def call_seconds(backend: str, point: AttentionPoint) -> tuple[float, float]:
    """(forward, backward) seconds of one call of `backend` at `point` on the CPU; the count is the dense one
    (windows and documents compute fewer scores), so this errs long."""
    fwd, bwd = point.flop("fwd"), point.flop("bwd")
    if backend in INTERPRETED:
        # The backward launches two kernels (dk/dv, then dq) where the forward launches one.
        return INTERPRETER_LAUNCH_S + fwd / INTERPRETER_FLOPS, 2 * INTERPRETER_LAUNCH_S + bwd / INTERPRETER_FLOPS
    return fwd / TORCH_FLOPS, (0.0 if backend in FORWARD_ONLY_ON_CPU else bwd / TORCH_FLOPS)


def sweep_seconds(points: Sequence[AttentionPoint], backends: Sequence[str], warmup: int, iters: int,
                  timed: bool = True, rounds: int = 1) -> float:
    """Seconds the sweep would take on the CPU. Each backend at each point runs a warm-up forward+backward, the
    measured one, and when timed `rounds` times the three timed passes (forward, forward+backward, backward), each
    `warmup` + `iters` calls: about 2 * (rounds * (warmup + iters) + 2) forwards and as many backwards."""
    calls = 2 * (rounds * (warmup + iters) + 2) if timed else 2
    total = 0.0
    for point in points:
        for backend in backends:
            fwd, bwd = call_seconds(backend, point)
            total += calls * (fwd + bwd) + (COMPILE_S if backend in COMPILED else 0.0)
    return total


def rough(seconds: float) -> str:
    """A duration to one significant figure or so: '40 s', '12 min', '3 h', '80 days'."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.0f} s"
