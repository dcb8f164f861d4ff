"""Out-of-memory as a result, not a crash: catch it, free memory, report it; plus a hook to inject one in tests.

    outcome = call_catching_oom(lambda: run_point(...), label="naive seq=16384 d=64 fp32")
    if outcome.oom:
        row["status"] = "OOM"          # the sweep goes on with the next point

Test hook: set the environment variable BENCH_INJECT_OOM to comma-separated substrings; any guarded call
whose label contains one of them raises `InjectedOOM` (a `torch.OutOfMemoryError`) before running, so a test
can prove that a sweep records the OOM row and continues. `inject=` does the same per call.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

import torch

INJECT_OOM_ENV = "BENCH_INJECT_OOM"
OOM_STATUS = "OOM"

T = TypeVar("T")

# Phrases allocators use: CUDA caching allocator, the CPU allocator, and backends that re-wrap them
# (torch.compile / triton can re-raise an OOM inside another exception type with the message kept).
_OOM_PHRASES = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


class InjectedOOM(torch.OutOfMemoryError):
    """An OOM raised on purpose by the test hook."""


def is_oom(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError, MemoryError, or an error whose message says memory ran out."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(p in message for p in _OOM_PHRASES)
    return False


def free_memory() -> None:
    """Drop unreachable tensors and return cached CUDA blocks, so the next point starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def injected_oom_patterns(inject: Optional[str] = None) -> list[str]:
    """Substrings that trigger an injected OOM: from `inject`, else from $BENCH_INJECT_OOM."""
    raw = inject if inject is not None else os.environ.get(INJECT_OOM_ENV, "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def maybe_inject_oom(label: str, inject: Optional[str] = None) -> None:
    """Raise InjectedOOM if `label` contains one of the injection substrings."""
    for pattern in injected_oom_patterns(inject):
        if pattern in label:
            raise InjectedOOM(f"injected out of memory for {label!r} (matched {pattern!r} via {INJECT_OOM_ENV})")


def short_message(exc: BaseException, limit: int = 200) -> str:
    """First line of an exception, cut to `limit` characters (CUDA OOM messages run to a paragraph)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Outcome(Generic[T]):
    """What a guarded call gave: its value, or that it ran out of memory (and the message)."""

    value: Optional[T] = None
    oom: bool = False
    message: Optional[str] = None

    @property
    def status(self) -> str:
        return OOM_STATUS if self.oom else "ok"


def call_catching_oom(fn: Callable[[], T], label: str = "", inject: Optional[str] = None) -> Outcome[T]:
    """Run `fn()`; an OOM becomes Outcome(oom=True) with memory freed. Other exceptions propagate.

    Memory is freed after the except block ends, when the traceback (and the frames holding the
    tensors that filled memory) has been released.
    """
    message = None
    try:
        maybe_inject_oom(label, inject)
        return Outcome(value=fn())
    except BaseException as exc:  # noqa: BLE001 -- filtered by is_oom, everything else re-raised
        if not is_oom(exc):
            raise
        message = short_message(exc)
    free_memory()
    return Outcome(oom=True, message=message)


class catch_oom:
    """Context manager form: an OOM inside the block ends the block and sets `guard.oom`, `guard.message`.

        with catch_oom(label) as guard:
            guard.maybe_inject()     # honour the test hook (a context manager cannot skip its block)
            ...
        free_memory()                # the block's big tensors are released only once the traceback is gone
    """

    def __init__(self, label: str = "", inject: Optional[str] = None):
        self.label, self.inject = label, inject
        self.oom = False
        self.message: Optional[str] = None

    def maybe_inject(self) -> None:
        """Raise an InjectedOOM here if the label matches the test hook."""
        maybe_inject_oom(self.label, self.inject)

    def __enter__(self) -> "catch_oom":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        if exc is None or not is_oom(exc):
            return False
        self.oom, self.message = True, short_message(exc)
        free_memory()
        return True
