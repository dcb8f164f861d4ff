"""What flash's kernels and its reference share: output buffers, (batch, heads, seq, d) views, document bounds."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, Optional

import torch

from attention.masks import doc_bounds

_nan_filled = False


@functools.cache
def sm_count(device_index: int) -> int:
    """The streaming multiprocessors of a CUDA device: how many programs a kernel's wave holds."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@contextlib.contextmanager
def nan_filled_outputs() -> Iterator[None]:
    """Inside: outputs and gradients start filled with NaN instead of uninitialised memory.

    A test hook: an element a kernel never writes then shows up as NaN, so tests can prove every element is written.
    """
    global _nan_filled
    saved, _nan_filled = _nan_filled, True
    try:
        yield
    finally:
        _nan_filled = saved


def bounds_of(q: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A call's document bounds (attention.masks.doc_bounds) for the kernels, None without documents; q as the
    registry takes it."""
    return None if doc_ids is None else doc_bounds(doc_ids, tuple(q.shape[:-3]), q.shape[-2])


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _nan_filled:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """An output shaped like t and, up to 4 dims, in t's memory order.

    A (batch, heads, seq, d) view of (batch, seq, heads, d) storage gets an output in that order, so the caller's
    "b h s d -> b s (h d)" is a view, as after cuDNN SDPA. Above 4 dims: contiguous, which as_bhsd can view.
    """
    if t.dim() > 4:
        return empty(tuple(t.shape), t.dtype, t.device)
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if _nan_filled else out


def as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): a view unless the leading dims cannot merge (then a copy)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    if t.dim() == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensor's (when it is another)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def default_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
