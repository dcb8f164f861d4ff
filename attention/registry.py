"""The attention registry: backends by name, and why one cannot run a given input.

Every backend computes softmax(q k^T * scale [+ causal mask]) v on tensors shaped
(..., seq, d_head). Backends register themselves with `register`; callers ask by name
with `get_attention`, so the model never knows which kernel runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
DecodeCheck = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Optional[str]]
DecodeFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., torch.Tensor]  # fn(q, k, v, causal, scale) on validated inputs
    description: str
    environment_check: EnvironmentCheck = field(default=lambda: None)
    input_check: InputCheck = field(default=lambda q, k, v, causal: None)
    decode: Optional[DecodeFn] = None  # decode(q, k_cache, v_cache, cache_len, scale), see attention/decode.py
    decode_check: DecodeCheck = field(default=lambda q, k_cache, v_cache: None)


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

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor, *,
               scale: Optional[float] = None) -> torch.Tensor:
        reason = why_not_decode(name, q, k_cache, v_cache, cache_len)
        if reason is not None:
            raise UnsupportedInputError(f"attention backend {name!r} cannot decode this input: {reason}")
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _BACKENDS[name].decode(q, k_cache, v_cache, cache_len, scale)

    attention.decode = decode
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


def register_decode(name: str, *, input_check: DecodeCheck = lambda q, k_cache, v_cache: None
                    ) -> Callable[[DecodeFn], DecodeFn]:
    """Decorator: give the registered backend `name` a decode path `fn(q, k_cache, v_cache, cache_len, scale)`.

    Decode attention (attention/decode.py): q (..., heads, n_new, d_head) against the first cache_len positions
    of k_cache, v_cache (..., heads, max_len, d_head); callers reach it as `get_attention(name).decode(...)`.
    """

    def decorate(fn: DecodeFn) -> DecodeFn:
        if name not in _BACKENDS:
            raise UnknownBackendError(f"decode for unknown attention backend {name!r}")
        if _BACKENDS[name].decode is not None:
            raise ValueError(f"attention backend {name!r} has two decode paths")
        _BACKENDS[name] = dataclasses.replace(_BACKENDS[name], decode=fn, decode_check=input_check)
        return fn

    return decorate


def validate_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_len: int | torch.Tensor) -> None:
    """Shape, dtype and device checks of a decode call; raises UnsupportedInputError naming the problem."""
    validate_qkv(q, k_cache, v_cache, causal=False)
    if q.shape[-2] > k_cache.shape[-2]:
        raise UnsupportedInputError(f"{q.shape[-2]} new queries do not fit a cache of {k_cache.shape[-2]} positions")
    if isinstance(cache_len, torch.Tensor):
        lead = q.shape[:-2]
        if cache_len.is_floating_point() or cache_len.is_complex() or cache_len.dim() > len(lead) \
                or tuple(cache_len.shape) != tuple(lead[:cache_len.dim()]):
            raise UnsupportedInputError(f"cache_len must be an integer tensor shaped like the leading dims of q "
                                        f"{tuple(lead)} (e.g. (batch,)), got {cache_len.dtype} "
                                        f"{tuple(cache_len.shape)}")
        if cache_len.device != q.device:
            raise UnsupportedInputError(f"cache_len must be on q's device {q.device}, got {cache_len.device}")
    elif not q.shape[-2] <= cache_len <= k_cache.shape[-2]:
        raise UnsupportedInputError(f"cache_len must be in {q.shape[-2]}..{k_cache.shape[-2]} (the new queries "
                                    f"..the cache size), got {cache_len}")


def why_not_decode(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_len: int | torch.Tensor) -> Optional[str]:
    """None if backend `name` can run this decode call, else the reason (no exception)."""
    b = _BACKENDS[name]
    if b.decode is None:
        return "it has no decode path"
    try:
        validate_decode(q, k_cache, v_cache, cache_len)
    except UnsupportedInputError as e:
        return str(e)
    return b.environment_check() or b.decode_check(q, k_cache, v_cache)
