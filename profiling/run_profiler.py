"""`train.py --profile DIR`: torch.profiler over a window of a run's steps, on every rank.

Each rank writes DIR/trace-rank<r>.json (a Chrome trace: https://ui.perfetto.dev) and DIR/kernels-rank<r>.md (its
top kernels, or CPU operators on the CPU, and on a GPU how its time split between computing, communicating and
waiting for the host: profiling/torch_profile.py). The window starts SETTLE_STEPS after the warm-up, so that compiling,
capturing and the first slower steps stay out of it; a run too short for that profiles its last steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from profiling.torch_profile import write_profile

SETTLE_STEPS = 10  # steps between the warm-up and the window: the first ones after it still run slower


def profile_window(first: int, warm: int, steps: int, count: int) -> tuple[int, int]:
    """(start, count) of the window of a run from step `first` (0-based) to `steps`: `count` steps from SETTLE_STEPS
    after the warm-up (the step before the window warms the profiler up), or the last `count` steps of a run too short
    for that; count is 0 when the run has no step after its first."""
    start = max(first + 1, min(first + warm + SETTLE_STEPS, steps - count))
    return start, max(0, min(count, steps - start))


class RunProfiler:
    """Call `before_step(step)` before each step (0-based index of the step about to run) and `after_step(done)` after
    it (the number of steps done); the window is [start, start + count), start >= 1. `close()` stops a window a run
    left early."""

    def __init__(self, out_dir: Path, start: int, count: int, device: torch.device, rank: int,
                 warn: Callable[[str], None] = print):
        self.out_dir, self.start, self.end, self.device, self.rank = Path(out_dir), start, start + count, device, rank
        self.warn = warn  # a file that cannot be written is said, and the run goes on
        self._prof: Optional[profile] = None

    def before_step(self, step: int) -> None:
        if step == self.start - 1:  # the profiler's warm-up step, whose events it drops
            self._synchronize()  # earlier steps' kernels stay out of the window
            # On a GPU its kernels only: recording every host operator too would slow the host-bound parts of a
            # step, which the trace would then show as the GPU waiting.
            activities = [ProfilerActivity.CUDA] if self.device.type == "cuda" else [ProfilerActivity.CPU]
            self._prof = profile(activities=activities,
                                 schedule=schedule(wait=0, warmup=1, active=self.end - self.start))
            self._prof.start()
        elif self._prof is not None:
            if step == self.start:
                self._synchronize()  # the warm-up step's kernels stay out of the first recorded step
            self._prof.step()

    def after_step(self, done: int) -> Optional[str]:
        """At the window's end: stop, write this rank's files, and return the line that says where they are."""
        if self._prof is None or done != self.end:
            return None
        self._synchronize()
        prof, self._prof = self._prof, None
        prof.stop()
        trace, kernels = self.out_dir / f"trace-rank{self.rank}.json", self.out_dir / f"kernels-rank{self.rank}.md"
        steps, on_gpu = self.end - self.start, self.device.type == "cuda"
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            _, split = write_profile(prof, trace, kernels, on_gpu, steps,
                                     title=f"steps {self.start + 1}-{self.end}, rank {self.rank}")
        except OSError as e:  # a full disk: the profile is lost, not the run
            self.warn(f"--profile {self.out_dir}: could not write the profile of rank {self.rank}: {e}")
            return None
        return f"profiled steps {self.start + 1}-{self.end}: {trace}, {kernels.name}" + (f"; {split}" if split else "")

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
