"""Sweeps that keep their results when stopped, and stop within seconds: SIGTERM (what `timeout` sends) and Ctrl-C.

A benchmark sweep catches KeyboardInterrupt around its loop and still writes every row it has, so a sweep
cut short by a time limit or Ctrl-C leaves a usable results.md/.csv/.json rather than nothing.

    with stops_promptly(write_so_far):    # write_so_far(reason): write the rows of the finished points
        for point in points: ...
    # KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one) leaves the block: write the rows, exit 130

Python runs a signal's handler only between two bytecodes of the main thread. One long C++ call (an attention
kernel at a long sequence on the CPU, a big matmul, a whole backward) therefore holds the KeyboardInterrupt back for
as long as it runs: half a minute at seq 32768 on two CPU cores, minutes at the GPU presets' sizes. So a watchdog
thread wakes on the signal itself (signal.set_wakeup_fd: the C-level handler writes the signal's number to a pipe at
once) and gives the main thread GRACE_S to leave the block; if it has not, the watchdog writes the rows itself with
write_so_far and ends the process with STOPPED_STATUS, dropping the point that was being measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

STOPPED_STATUS = 130  # 128 + SIGINT, what a shell reports for Ctrl-C; the files hold the rows so far
GRACE_S = 3.0  # time the main thread has to leave the block itself (a short C call ends well within it)
STOP_SIGNALS = {int(signal.SIGTERM): "SIGTERM", int(signal.SIGINT): "Ctrl-C (SIGINT)"}
_STAND_DOWN = b"\0"  # written to the pipe by the block's exit; no signal has number 0


def tell(line: str) -> None:
    """Print a line of the stop to stderr, if anything still reads it: the Ctrl-C that stops `bench ... | tee log`
    ends tee as well, and a print raising BrokenPipeError then would stop the results from being written."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed pipe, or a closed file
        pass


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


def stop_reason(interrupt: BaseException) -> str:
    """'SIGTERM' for a signal that sigterm_as_interrupt turned into KeyboardInterrupt, else 'Ctrl-C (SIGINT)'."""
    text = str(interrupt)
    return text.removeprefix("signal ") if text.startswith("signal SIG") else STOP_SIGNALS[int(signal.SIGINT)]


class _Watchdog:
    """The thread that ends the process when the main thread is held in a long call past the grace time."""

    def __init__(self, write_so_far: Callable[[str], None], grace_s: float):
        self.write_so_far, self.grace_s = write_so_far, grace_s
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd needs it: a signal handler must never block
        self.lock = threading.Lock()
        self.left = threading.Event()  # the main thread has left the block
        self.stopping = False  # the watchdog is writing the rows and ending the process
        self.thread = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)

    def _next_stop_signal(self) -> Optional[str]:
        while True:
            data = os.read(self.read_fd, 64)  # blocks without the GIL until a signal or the stand-down byte
            if not data or _STAND_DOWN in data:
                return None
            names = [STOP_SIGNALS[b] for b in data if b in STOP_SIGNALS]  # other handled signals are not stops
            if names:
                return names[0]

    def _watch(self) -> None:
        reason = self._next_stop_signal()
        if reason is None or self.left.wait(self.grace_s):
            return
        with self.lock:
            if self.left.is_set():
                return
            self.stopping = True
        try:
            tell(f"stopping now ({reason}) without waiting for the call in progress; the point it belongs to is "
                 "dropped")
            self.write_so_far(reason)
        except BaseException as e:  # noqa: BLE001 -- the process ends either way; say why the files may lack rows
            tell(f"error: writing the results so far failed: {type(e).__name__}: {e}")
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(STOPPED_STATUS)  # the main thread is still inside its call: nothing else can end it

    def leave(self) -> None:
        """The main thread leaves the block: stand the watchdog down, or wait for it to end the process."""
        with self.lock:
            self.left.set()
            stopping = self.stopping
        if stopping:  # the watchdog writes the files; writing them here too would race with it
            while True:
                try:
                    threading.Event().wait()
                except KeyboardInterrupt:
                    continue
        with contextlib.suppress(BlockingIOError):  # a full pipe already holds bytes that wake the thread
            os.write(self.write_fd, _STAND_DOWN)
        self.thread.join()
        os.close(self.read_fd)
        os.close(self.write_fd)


@contextlib.contextmanager
def stops_promptly(write_so_far: Callable[[str], None], grace_s: float = GRACE_S) -> Iterator[None]:
    """Within the block, SIGTERM and Ctrl-C raise KeyboardInterrupt; if the main thread is held in one call for
    `grace_s` after the signal, write_so_far(reason) runs on a watchdog thread and the process exits with status
    STOPPED_STATUS. write_so_far must write only what is finished (the main thread is still mid-point).
    Outside the main thread this is sigterm_as_interrupt alone."""
    if threading.current_thread() is not threading.main_thread():
        with sigterm_as_interrupt():
            yield
        return
    watchdog = _Watchdog(write_so_far, grace_s)
    previous_fd = signal.set_wakeup_fd(watchdog.write_fd, warn_on_full_buffer=False)
    watchdog.thread.start()
    try:
        with sigterm_as_interrupt():
            yield
    finally:
        signal.set_wakeup_fd(previous_fd)  # another user of the wakeup fd (an event loop) gets it back
        watchdog.leave()


def note_interrupted(done: int, total: int, reason: str = "", dropped: str = "") -> str:
    """The one line that says the sweep stopped early, why, and which point (being measured) is left out."""
    why = f" by {reason}" if reason else ""
    left_out = f"; {dropped} was being measured and is left out" if dropped else ""
    message = f"sweep stopped early{why}: {done} of {total} runs done{left_out}; writing the results so far"
    tell(message)
    return message
