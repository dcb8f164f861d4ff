"""Sweeps that keep their results when stopped: SIGTERM (what `timeout` sends) becomes KeyboardInterrupt.

A benchmark sweep catches KeyboardInterrupt around its loop and still writes every row it has, so a sweep
cut short by a time limit or Ctrl-C leaves a usable results.md/.csv/.json rather than nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (main thread only; elsewhere a no-op)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def note_interrupted(done: int, total: int) -> str:
    message = f"sweep stopped early: {done} of {total} runs done; writing the results so far"
    print(message, file=sys.stderr)
    return message
