"""Progress of long work: a tqdm bar on a terminal; plain lines with the time left when the output is piped.

A file or a pipe never receives a carriage return: there, `Progress` prints a line at each `report` and, between
reports, one at most every `every_s` seconds, each with the rate and an estimate of the time left.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional

from tqdm import tqdm


def duration(seconds: float) -> str:
    """3.2 s, 4 min 10 s, 2 h 05 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class Progress:
    """Progress over `total` units (steps, bytes, configurations), from `initial`."""

    def __init__(self, total: Optional[int], desc: str, unit: str = "step", initial: int = 0, every_s: float = 30.0,
                 file: Optional[IO[str]] = None, enabled: bool = True):
        self.file = file or sys.stderr
        self.total, self.desc, self.unit, self.done = total, desc, unit, initial
        self.every_s, self.enabled = every_s, enabled
        self.tty = enabled and self.file.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=self.file,
                        unit_scale=unit == "B") if self.tty else None
        self.start_time = self.last_line = time.perf_counter()
        self.start_done = initial

    def restart_clock(self) -> None:
        """Estimate the time left from now on (after a warm-up that does not run at speed)."""
        self.start_time, self.start_done = time.perf_counter(), self.done

    def left(self) -> Optional[float]:
        """Seconds left at the rate since the clock started; None before any unit."""
        rate = (self.done - self.start_done) / max(time.perf_counter() - self.start_time, 1e-9)
        if self.total is None or rate <= 0:
            return None
        return (self.total - self.done) / rate

    def _line(self, text: str) -> str:
        where = f"{self.done:,}/{self.total:,}" if self.total is not None else f"{self.done:,}"
        left = self.left()
        tail = f", {duration(left)} left" if left is not None and self.done < (self.total or 0) else ""
        return f"{self.desc} {where} {self.unit}{'s' if self.unit != 'B' else ''}{tail}" + (f": {text}" if text else "")

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.perf_counter() - self.last_line >= self.every_s:
            self.report("")

    def report(self, text: str) -> None:
        """Show `text` (the latest figures): the bar's postfix on a terminal, else a line of its own."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(self._line(text), file=self.file, flush=True)
            self.last_line = time.perf_counter()

    def write(self, line: str) -> None:
        """A line of its own that does not break the bar."""
        if self.bar is not None:
            self.bar.write(line, file=self.file)
        elif self.enabled:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
