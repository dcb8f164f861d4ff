"""The attention registry: backends by name, and why one cannot run a given input.

Every backend computes softmax(q k^T * scale [+ causal mask]) v on tensors shaped
(..., seq, d_head). Backends register themselves with `register`; callers ask by name
with `get_attention`, so the model never knows which kernel runs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import torch


class AttentionFn(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None
    ) -> torch.Tensor: ...


class UnknownBackendError(KeyError):
    """Raised for a name that no backend registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class UnsupportedInputError(ValueError):
    """Raised when a backend cannot run an input; the message says why."""


# A check returns None when the backend can run, else the reason it cannot.
EnvironmentCheck = Callable[[], Optional[str]]
InputCheck = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Optional[str]]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., torch.Tensor]  # fn(q, k, v, causal, scale) on validated inputs
    description: str
    environment_check: EnvironmentCheck = field(default=lambda: None)
    input_check: InputCheck = field(default=lambda q, k, v, causal: None)


@dataclass(frozen=True)
class BackendStatus:
    """One row of `list_attention()`."""

    name: str
    available: bool
    reason: Optional[str]  # why it cannot run here, when not available
    description: str


_BACKENDS: dict[str, Backend] = {}


def register(
    name: str,
    *,
    description: str,
    environment_check: EnvironmentCheck = lambda: None,
    input_check: InputCheck = lambda q, k, v, causal: None,
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register `fn(q, k, v, causal, scale) -> o` under `name`."""

    def decorate(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is registered twice")
        _BACKENDS[name] = Backend(name, fn, description, environment_check, input_check)
        return fn

    return decorate


def backend_names() -> list[str]:
    return list(_BACKENDS)


def list_attention() -> list[BackendStatus]:
    """Every backend, with whether it can run on this machine and, if not, why."""
    rows = []
    for b in _BACKENDS.values():
        reason = b.environment_check()
        rows.append(BackendStatus(b.name, reason is None, reason, b.description))
    return rows


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Checks shared by every backend; raises UnsupportedInputError naming the problem."""
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise UnsupportedInputError(f"{n} must be shaped (..., seq, d_head), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise UnsupportedInputError(f"{n} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise UnsupportedInputError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UnsupportedInputError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise UnsupportedInputError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise UnsupportedInputError(
            f"q and k must share leading dims, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise UnsupportedInputError(f"q and k must share d_head, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise UnsupportedInputError(f"sequence length must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise UnsupportedInputError(
            f"causal attention needs equal query and key lengths, got {q.shape[-2]} and {k.shape[-2]}"
        )


def get_attention(name: str) -> AttentionFn:
    """The backend registered as `name`, wrapped with input validation."""
    if name not in _BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; valid: {', '.join(_BACKENDS)}")
    backend = _BACKENDS[name]

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None
    ) -> torch.Tensor:
        validate_qkv(q, k, v, causal)
        reason = backend.environment_check() or backend.input_check(q, k, v, causal)
        if reason is not None:
            raise UnsupportedInputError(f"attention backend {name!r} cannot run this input: {reason}")
        return backend.fn(q, k, v, causal, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))

    attention.__name__ = f"attention_{name}"
    attention.__doc__ = backend.description
    return attention


# How many graph_replay() blocks are open. Process-wide, not per thread: autograd runs the backward on a thread of
# its own, and it must see what the forward saw.
_graph_replay_depth = 0


@contextlib.contextmanager
def graph_replay() -> Iterator[None]:
    """Inside: attention calls are captured in a CUDA graph and replayed, so their host time is paid once.

    A backend may then pick the kernels with the least GPU time even where their launches cost more host time
    (flash's Hopper kernels on short sequences). Wrap the eager warm-up calls as well as the capture: code that
    torch.compile traces there keeps the choice, and the kernels the capture launches get compiled before it.
    """
    global _graph_replay_depth
    _graph_replay_depth += 1
    try:
        yield
    finally:
        _graph_replay_depth -= 1


def graph_replay_requested() -> bool:
    """Whether a graph_replay() block is open. Compiled code that reads this guards on it (it recompiles when the
    answer changes), so it is what a backend reads while torch.compile traces it."""
    return _graph_replay_depth > 0


def launches_replayed() -> bool:
    """Whether attention calls made now will be replayed from a CUDA graph: inside graph_replay(), or while the
    current CUDA stream is being captured."""
    return graph_replay_requested() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def why_not(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Optional[str]:
    """None if backend `name` can run this input, else the reason (no exception)."""
    try:
        validate_qkv(q, k, v, causal)
    except UnsupportedInputError as e:
        return str(e)
    b = _BACKENDS[name]
    return b.environment_check() or b.input_check(q, k, v, causal)
