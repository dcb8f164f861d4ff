"""The attention registry: backends by name, and why one cannot run a given input.

Every backend computes softmax(q k^T * scale [+ mask]) v on tensors shaped (..., seq, d_head). Backends register
themselves with `register`; callers ask by name with `get_attention`, so the model never knows which kernel runs:

    o = attn(q, k, v, causal=False, scale=None, window=None, softcap=None, doc_ids=None)

The variants beyond plain multi-head attention (docs/flash.md, Variants), all combinable:
    GQA/MQA   q (..., h_q, n_q, d), k and v (..., h_kv, n_k, d) with h_q % h_kv == 0; query head i uses key/value
              head i // (h_q // h_kv). Leading dims before the heads must match.
    window    int >= 1. With causal, query i sees keys j with i - window < j <= i; without, |i - j| < window.
    softcap   float > 0. The scores s = scale * q.k become softcap * tanh(s / softcap) before the softmax.
    doc_ids   integer tensor broadcastable to q.shape[:-3] + (n,), non-decreasing along the sequence; self-attention
              only (n_q == n_k). Position i attends j only where doc_ids[i] == doc_ids[j].
A backend lists the variants it runs (`register(..., variants=...)`); `why_not` says why one cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import torch


class AttentionFn(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
        window: Optional[int] = None, softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None,
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

# The variants a backend may support, and how a refusal names them.
VARIANTS = {
    "gqa": "grouped-query attention (fewer key/value heads than query heads)",
    "window": "sliding windows",
    "softcap": "logit soft-capping",
    "doc_ids": "document masks (doc_ids)",
}


@dataclass(frozen=True)
class Variant:
    """The validated variant arguments of one call; None where not used."""

    window: Optional[int] = None
    softcap: Optional[float] = None
    doc_ids: Optional[torch.Tensor] = None

    def kwargs(self) -> dict:
        """The arguments a backend function gets beyond (q, k, v, causal, scale): only those in use, so that plain
        calls reach every backend exactly as before variants existed."""
        return {n: x for n, x in (("window", self.window), ("softcap", self.softcap), ("doc_ids", self.doc_ids))
                if x is not None}

    def used(self, q: torch.Tensor, k: torch.Tensor) -> list[str]:
        """The names (keys of VARIANTS) of the variants this call uses."""
        return (["gqa"] if kv_groups(q, k) > 1 else []) + list(self.kwargs())


PLAIN = Variant()
# The variants a decode path may run (documents do not apply: a cache holds one sequence per batch row).
DECODE_VARIANTS = {n: VARIANTS[n] for n in ("gqa", "window", "softcap")}
# (q, k, v, causal, variant) -> None, or why a backend cannot run a variant it supports in general.
VariantCheck = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, Variant], Optional[str]]


def kv_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per key/value head: h_q // h_kv (1 without a head dim)."""
    return q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] else 1


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., torch.Tensor]  # fn(q, k, v, causal, scale, **variant.kwargs()) on validated inputs
    description: str
    environment_check: EnvironmentCheck = field(default=lambda: None)
    input_check: InputCheck = field(default=lambda q, k, v, causal: None)
    decode: Optional[DecodeFn] = None  # decode(q, k_cache, v_cache, cache_len, scale), see attention/decode.py
    decode_check: DecodeCheck = field(default=lambda q, k_cache, v_cache: None)
    decode_variants: frozenset = frozenset()  # of "gqa", "window", "softcap": what its decode path runs
    variants: frozenset = frozenset()  # the keys of VARIANTS it runs
    variant_check: VariantCheck = field(default=lambda q, k, v, causal, variant: None)


@dataclass(frozen=True)
class BackendStatus:
    """One row of `list_attention()`."""

    name: str
    available: bool
    reason: Optional[str]  # why it cannot run here, when not available
    description: str
    variants: tuple[str, ...] = ()  # the keys of VARIANTS it runs


_BACKENDS: dict[str, Backend] = {}


def register(
    name: str,
    *,
    description: str,
    environment_check: EnvironmentCheck = lambda: None,
    input_check: InputCheck = lambda q, k, v, causal: None,
    variants: tuple[str, ...] = (),
    variant_check: Optional[VariantCheck] = None,
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register `fn(q, k, v, causal, scale, **variant) -> o` under `name`.

    variants: the keys of VARIANTS it runs; fn gets those in use as keyword arguments (window=, softcap=,
    doc_ids= as given to the call, GQA through the shapes of q and k). variant_check(q, k, v, causal, variant):
    why it cannot run a particular use of them (e.g. a mask too large to materialise), or None.
    """
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown attention variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}")

    def decorate(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is registered twice")
        _BACKENDS[name] = Backend(name, fn, description, environment_check, input_check,
                                  variants=frozenset(variants),
                                  variant_check=variant_check or (lambda q, k, v, causal, variant: None))
        return fn

    return decorate


def backend_names() -> list[str]:
    return list(_BACKENDS)


def list_attention() -> list[BackendStatus]:
    """Every backend, with whether it can run on this machine and, if not, why."""
    rows = []
    for b in _BACKENDS.values():
        reason = b.environment_check()
        rows.append(BackendStatus(b.name, reason is None, reason, b.description,
                                  tuple(n for n in VARIANTS if n in b.variants)))
    return rows


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, allow_gqa: bool = False) -> None:
    """Checks shared by every backend; raises UnsupportedInputError naming the problem.

    allow_gqa: k and v may have fewer heads (dim -3) than q, a divisor of q's."""
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
    if allow_gqa and q.dim() >= 3 and q.dim() == k.dim() and q.shape[:-3] == k.shape[:-3] \
            and q.shape[-3] != k.shape[-3]:
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            raise UnsupportedInputError(
                f"q and k must share leading dims, up to grouped-query attention, where q's heads (dim -3) are a "
                f"multiple of k's: got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
    elif q.shape[:-2] != k.shape[:-2]:
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


def validate_variant(q: torch.Tensor, k: torch.Tensor, causal: bool, window: Optional[int] = None,
                     softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None) -> Variant:
    """The variant arguments of a call on validated q, k, checked; raises UnsupportedInputError naming the problem."""
    if window is None and softcap is None and doc_ids is None:
        return PLAIN
    n_q, n_k = q.shape[-2], k.shape[-2]
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
            raise UnsupportedInputError(f"window must be an integer >= 1, got {window!r}")
        window = int(window)
        # Without causal, query i sees keys i - window < j < i + window: rows past n_k + window - 1 would see none.
        if not causal and n_q > n_k + window - 1:
            raise UnsupportedInputError(
                f"with window {window}, queries {n_k + window - 1}.. of {n_q} would see no key of {n_k}"
            )
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (
                math.isfinite(softcap) and softcap > 0):
            raise UnsupportedInputError(f"softcap must be a finite number > 0, got {softcap!r}")
        softcap = float(softcap)
    if doc_ids is not None:
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.is_floating_point() or doc_ids.is_complex() \
                or doc_ids.dtype == torch.bool:
            what = f"{doc_ids.dtype} tensor" if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
            raise UnsupportedInputError(f"doc_ids must be an integer tensor, got a {what}")
        if n_q != n_k:
            raise UnsupportedInputError(
                f"doc_ids is for self-attention: it needs equal query and key lengths, got {n_q} and {n_k}"
            )
        lead = tuple(q.shape[:-3])
        shape = tuple(doc_ids.shape)
        broadcastable = 1 <= len(shape) <= len(lead) + 1 and shape[-1] == n_q and all(
            a in (1, b) for a, b in zip(reversed(shape[:-1]), reversed(lead)))
        if not broadcastable:
            raise UnsupportedInputError(
                f"doc_ids must be broadcastable to q.shape[:-3] + (seq,) = {lead + (n_q,)}, got shape {shape}"
            )
        if doc_ids.device != q.device:
            raise UnsupportedInputError(f"doc_ids must be on q's device {q.device}, got {doc_ids.device}")
        # Checked on the CPU in eager code only: on a GPU it would cost a device sync per call, and compiled code
        # cannot branch on tensor values. Kernels that skip tiles rely on it: unchecked, ids out of order give flash
        # wrong results (NaN rows). training/packing.py makes them in order.
        if doc_ids.device.type == "cpu" and n_q > 1 and not torch.compiler.is_compiling() \
                and bool((doc_ids[..., 1:] < doc_ids[..., :-1]).any()):
            raise UnsupportedInputError("doc_ids must be non-decreasing along the sequence (packed documents)")
    return Variant(window, softcap, doc_ids)


def variant_problem(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    variant: Variant) -> Optional[str]:
    """Why `backend` cannot run the variants this call uses, or None."""
    used = variant.used(q, k)
    if not used:
        return None
    missing = [VARIANTS[n] for n in used if n not in backend.variants]
    if missing:
        return f"it does not support {', '.join(missing)}"
    return backend.variant_check(q, k, v, causal, variant)


_MAX_ACCEPTED = 1024  # accepted call signatures kept per get_attention() function; past it the set starts again


def _accept(accepted: set[tuple], key: Optional[tuple]) -> None:
    """Remember a signature whose checks passed (None: a call that is checked every time), within _MAX_ACCEPTED."""
    if key is None:
        return
    if len(accepted) >= _MAX_ACCEPTED:
        accepted.clear()
    accepted.add(key)


def _call_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: Optional[int],
                    softcap: Optional[float]) -> Optional[tuple]:
    """Everything the checks of a call without documents read (shapes, dtypes, devices, whether gradients are
    wanted, the arguments), so that a signature they passed once is not checked again: eager calls of short
    sequences are bound by host time. None where calls are not cached: while compiling (the checks are traced once),
    and for arguments of other types."""
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor \
            or type(v) is not torch.Tensor or type(causal) is not bool or not (window is None or type(window) is int) \
            or not (softcap is None or type(softcap) is float):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.requires_grad,
            k.requires_grad, v.requires_grad, torch.is_grad_enabled(), causal, window, softcap)


def _decode_signature(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
                      window: Optional[int], softcap: Optional[float]) -> Optional[tuple]:
    """_call_signature for a decode call, with cache_len: a tensor by shape, dtype and device (its values are the
    caller's promise, never checked), an int by value (the checks bound it)."""
    key = _call_signature(q, k_cache, v_cache, True, window, softcap)
    if key is None:
        return None
    if type(cache_len) is torch.Tensor:
        return key + (cache_len.shape, cache_len.dtype, cache_len.device)
    return key + (cache_len,) if type(cache_len) is int else None


def get_attention(name: str) -> AttentionFn:
    """The backend registered as `name`, wrapped with input validation."""
    if name not in _BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; valid: {', '.join(_BACKENDS)}")
    backend = _BACKENDS[name]

    accepted: set[tuple] = set()  # the signatures (_call_signature) of calls the checks passed

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
        window: Optional[int] = None, softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        key = _call_signature(q, k, v, causal, window, softcap) if doc_ids is None else None
        if key is not None and key in accepted:
            variant = PLAIN if window is None and softcap is None else Variant(window, softcap)
        else:
            validate_qkv(q, k, v, causal, allow_gqa=True)
            variant = validate_variant(q, k, causal, window, softcap, doc_ids)
            reason = (backend.environment_check() or backend.input_check(q, k, v, causal)
                      or variant_problem(backend, q, k, v, causal, variant))
            if reason is not None:
                raise UnsupportedInputError(f"attention backend {name!r} cannot run this input: {reason}")
            _accept(accepted, key)
        return backend.fn(q, k, v, causal, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                          **variant.kwargs())

    accepted_decode: set[tuple] = set()  # the signatures (_decode_signature) of decode calls the checks passed

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor, *,
               scale: Optional[float] = None, window: Optional[int] = None,
               softcap: Optional[float] = None) -> torch.Tensor:
        key = _decode_signature(q, k_cache, v_cache, cache_len, window, softcap)
        if key is None or key not in accepted_decode:
            reason = why_not_decode(name, q, k_cache, v_cache, cache_len, window=window, softcap=softcap)
            if reason is not None:
                raise UnsupportedInputError(f"attention backend {name!r} cannot decode this input: {reason}")
            _accept(accepted_decode, key)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        variant = {} if window is None and softcap is None else Variant(window, softcap).kwargs()
        return _BACKENDS[name].decode(q, k_cache, v_cache, cache_len, scale, **variant)

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


def why_not(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, *,
            window: Optional[int] = None, softcap: Optional[float] = None,
            doc_ids: Optional[torch.Tensor] = None) -> Optional[str]:
    """None if backend `name` can run this input (and these variants), else the reason (no exception)."""
    try:
        validate_qkv(q, k, v, causal, allow_gqa=True)
        variant = validate_variant(q, k, causal, window, softcap, doc_ids)
    except UnsupportedInputError as e:
        return str(e)
    b = _BACKENDS[name]
    return b.environment_check() or b.input_check(q, k, v, causal) or variant_problem(b, q, k, v, causal, variant)


def register_decode(name: str, *, input_check: DecodeCheck = lambda q, k_cache, v_cache: None,
                    variants: tuple[str, ...] = ()) -> Callable[[DecodeFn], DecodeFn]:
    """Decorator: give the registered backend `name` a decode path `fn(q, k_cache, v_cache, cache_len, scale)`.

    Decode attention (attention/decode.py): q (..., heads, n_new, d_head) against the first cache_len positions
    of k_cache, v_cache (..., kv heads, max_len, d_head); callers reach it as `get_attention(name).decode(...)`.
    variants: of "gqa" (fewer cache heads than query heads), "window" and "softcap", what fn runs; fn gets
    window= and softcap= as keyword arguments when they are in use.
    """
    unknown = set(variants) - set(DECODE_VARIANTS)
    if unknown:
        raise ValueError(f"unknown decode variants {sorted(unknown)}; valid: {', '.join(DECODE_VARIANTS)}")

    def decorate(fn: DecodeFn) -> DecodeFn:
        if name not in _BACKENDS:
            raise UnknownBackendError(f"decode for unknown attention backend {name!r}")
        if _BACKENDS[name].decode is not None:
            raise ValueError(f"attention backend {name!r} has two decode paths")
        _BACKENDS[name] = dataclasses.replace(_BACKENDS[name], decode=fn, decode_check=input_check,
                                              decode_variants=frozenset(variants))
        return fn

    return decorate


def validate_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_len: int | torch.Tensor) -> None:
    """Shape, dtype and device checks of a decode call; raises UnsupportedInputError naming the problem."""
    validate_qkv(q, k_cache, v_cache, causal=False, allow_gqa=True)
    if q.shape[-2] > k_cache.shape[-2]:
        raise UnsupportedInputError(f"{q.shape[-2]} new queries do not fit a cache of {k_cache.shape[-2]} positions")
    if isinstance(cache_len, torch.Tensor):
        lead = q.shape[:-2]
        if cache_len.is_floating_point() or cache_len.is_complex() or cache_len.dtype == torch.bool \
                or cache_len.dim() > len(lead) \
                or tuple(cache_len.shape) != tuple(lead[:cache_len.dim()]):
            raise UnsupportedInputError(f"cache_len must be an integer tensor shaped like the leading dims of q "
                                        f"{tuple(lead)} (e.g. (batch,)), got {cache_len.dtype} "
                                        f"{tuple(cache_len.shape)}")
        if cache_len.device != q.device:
            raise UnsupportedInputError(f"cache_len must be on q's device {q.device}, got {cache_len.device}")
    elif isinstance(cache_len, bool) or not isinstance(cache_len, numbers.Integral):
        raise UnsupportedInputError(f"cache_len must be an integer or an integer tensor, got {cache_len!r}")
    elif not q.shape[-2] <= cache_len <= k_cache.shape[-2]:
        raise UnsupportedInputError(f"cache_len must be in {q.shape[-2]}..{k_cache.shape[-2]} (the new queries "
                                    f"..the cache size), got {cache_len}")


def why_not_decode(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_len: int | torch.Tensor, *, window: Optional[int] = None,
                   softcap: Optional[float] = None) -> Optional[str]:
    """None if backend `name` can run this decode call (with these variants), else the reason (no exception)."""
    b = _BACKENDS[name]
    if b.decode is None:
        return "it has no decode path"
    try:
        validate_decode(q, k_cache, v_cache, cache_len)
        variant = validate_variant(q, k_cache, True, window, softcap)
    except UnsupportedInputError as e:
        return str(e)
    used = variant.used(q, k_cache)
    missing = [DECODE_VARIANTS[n] for n in used if n not in b.decode_variants]
    if missing:
        return f"its decode path does not run {', '.join(missing)}"
    return b.environment_check() or b.decode_check(q, k_cache, v_cache)
