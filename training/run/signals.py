"""Stop requests: SIGINT (Ctrl-C), SIGTERM and SIGUSR1 each ask the run to finish its step, checkpoint and stop.

SIGTERM is what `timeout`, SLURM preemption and Kubernetes send before they kill; SIGUSR1 is what a SLURM job asks
for ahead of its time limit (`#SBATCH --signal=USR1@120`). A run stopped this way saves its checkpoint and exits with
128 + the signal's number (`stop_status`): 130 after Ctrl-C, 143 after SIGTERM, 138 after SIGUSR1. A process that
was killed instead (the signal arrived before training started, or SIGKILL) is reported by its parent as killed by
the signal (Python's subprocess: a negative return code), not as exiting with a status.

A second Ctrl-C stops at once, without a checkpoint, by raising `Interrupted`; a repeated SIGTERM or SIGUSR1 is
ignored, so that a scheduler sending it twice does not cut the checkpoint short.

Under torchrun, the launcher forwards SIGINT and SIGTERM to every rank; the ranks agree on the stop step
(training.distributed.any_rank), so they all checkpoint the same one.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: stop now, without a checkpoint."""


def stop_status(signum: int) -> int:
    """The exit status of a run that a signal stopped after it saved its checkpoint."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StopRequest:
    """Installs the handlers of STOP_SIGNALS until restore(); `requested` turns true at the first one.

    announce=False (ranks other than 0) records the request without printing.
    """

    def __init__(self, announce: bool = True, say: Callable[[str], None] = _stderr):
        self.signum: Optional[int] = None
        self._announce = announce
        self._say = say
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        assert self.signum is not None, "no stop was requested"
        return stop_status(self.signum)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise Interrupted(f"{signal_name(signum)} again")
            return
        self.signum = signum
        if self._announce:
            again = " (press again to stop at once, without it)" if signum == signal.SIGINT else ""
            self._say(f"\n{signal_name(signum)}: saving a checkpoint at the end of this step, then stopping{again}")

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
