"""Run code on several local processes over gloo, the way torchrun would, for CPU tests.

Processes come from a forkserver that has already imported train.py, so each rank starts in well under a
second instead of re-importing torch (several seconds on a 2-core CI machine).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from training.parallel.distributed import DistContext

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "train", "tests.ranks"])


@dataclass
class RankResult:
    exit_code: Optional[int]  # None: still running at the deadline, then killed
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(rank: int, world_size: int, port: int, log_dir: str, target: Callable, args: tuple) -> None:
    """A rank's process: torchrun's variables, output to files, one thread, then `target(rank, *args)`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = open(Path(log_dir) / f"rank{rank}.out", "w", buffering=1)
    sys.stderr = open(Path(log_dir) / f"rank{rank}.err", "w", buffering=1)
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    code = target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def start_ranks(target: Callable, args: tuple, log_dir: Path, world_size: int = 2, timeout_s: float = 120,
                grace_s: float = 10) -> list[RankResult]:
    """`target(rank, *args)` on `world_size` ranks (its return value is the exit code); killed after timeout_s.

    `target` must be importable (a module-level function). Like torchrun, once a rank has failed the others
    get `grace_s` to fail too (they should, rather than hang) before they are killed.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [_CONTEXT.Process(target=_bootstrap, args=(r, world_size, port, str(log_dir), target, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        wait([p.sentinel for p in procs if p.is_alive()], timeout=max(0.0, deadline - time.monotonic()))
        if any(p.exitcode not in (None, 0, 130) for p in procs):
            deadline = min(deadline, time.monotonic() + grace_s)
    results = []
    for r, p in enumerate(procs):
        code = p.exitcode
        if p.is_alive():
            p.kill()
            p.join()
            code = None
        out, err = (log_dir / f"rank{r}.{kind}" for kind in ("out", "err"))
        results.append(RankResult(code, *(f.read_text() if f.exists() else "" for f in (out, err))))
    return results


def _train_main(rank: int, argv: list[str], log_dir: str, interrupt: Optional[tuple[int, ...]],
                die: Optional[tuple[int, int]], stall: Optional[tuple[int, int]]) -> int:
    import train
    from training.step import TrainingStep

    real_loss, calls = TrainingStep.loss, {"n": 0}

    def loss_with_events(*a):
        calls["n"] += 1
        if calls["n"] == 1:  # what this rank trains on at its first step: a = (step, ids of (per-rank batch, seq), ...)
            torch.save(a[1], Path(log_dir) / f"rank{rank}.first_inputs.pt")
        if interrupt is not None and interrupt[:2] == (rank, calls["n"]):
            # Ctrl-C (or the signal named third) reaching this rank alone, during its n-th loss
            os.kill(os.getpid(), interrupt[2] if len(interrupt) > 2 else signal.SIGINT)
        if die == (rank, calls["n"]):
            os._exit(17)  # a crashed rank: no clean-up, no goodbye to the others
        if stall == (rank, calls["n"]):
            time.sleep(3600)  # a stuck rank: alive, but never reaching the next collective
        return real_loss(*a)

    TrainingStep.loss = loss_with_events
    return train.main(argv)


def run_ranks(argv: list[str], log_dir: Path, world_size: int = 2, interrupt: Optional[tuple[int, ...]] = None,
              die: Optional[tuple[int, int]] = None, stall: Optional[tuple[int, int]] = None,
              timeout_s: float = 120, grace_s: float = 10) -> list[RankResult]:
    """train.main(argv) on `world_size` ranks, as `torchrun --nproc-per-node world_size train.py argv` would.

    interrupt / die / stall = (rank, n): Ctrl-C to / crash of / hang of that rank during its n-th loss computation;
    interrupt = (rank, n, signum) sends that signal instead of SIGINT.
    Each rank's inputs at its first step are saved to `log_dir/rank<r>.first_inputs.pt`.
    """
    return start_ranks(_train_main, (argv, str(log_dir), interrupt, die, stall), log_dir, world_size, timeout_s,
                       grace_s)


@contextmanager
def single_rank_group(parallel: str = "fsdp") -> Iterator[DistContext]:
    """A gloo process group of one rank in this process (FSDP and DCP need one even alone)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield DistContext(parallel, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
