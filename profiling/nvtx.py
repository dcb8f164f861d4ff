"""NVTX ranges that cost nothing unless enabled (by `bench_model.py --nvtx`).

`with nvtx.range("forward"): ...` pushes and pops an NVTX range so that
`nsys profile -t cuda,nvtx` shows it on the timeline. While disabled (the default) `range`
returns one shared null context, so code can stay annotated in the hot path.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

_enabled = False
_NULL = contextlib.nullcontext()


def enable(on: bool = True) -> None:
    """Turn NVTX ranges on (or off) for the whole process."""
    global _enabled
    _enabled = on


def is_enabled() -> bool:
    return _enabled


def unavailable() -> str | None:
    """Why NVTX ranges cannot be emitted here (a CPU-only PyTorch build), or None."""
    try:
        torch.cuda.nvtx.range_push("nvtx-probe")
        torch.cuda.nvtx.range_pop()
    except RuntimeError as e:
        return f"NVTX needs a CUDA build of PyTorch ({e})"
    return None


class _Range:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc) -> None:
        torch.cuda.nvtx.range_pop()


def range(name: str) -> ContextManager[None]:  # noqa: A001  (the name nsys users expect)
    """An NVTX range called `name` when enabled, else a no-op context.

    Inside code that torch.compile is tracing it is a no-op too: a push/pop there would split the graph.
    """
    if _enabled and not torch.compiler.is_compiling():
        return _Range(name)
    return _NULL
