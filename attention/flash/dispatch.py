"""Which of flash's kernels run an input, and the one way calls reach them.

`choose_kernels` says, for the forward and the backward, whether the Triton kernels (triton/) or the Hopper ones
(hopper/) run an input, and why. `forward` and `backward` ask the same rules and launch what they say; every call
reaches the kernels through them: eager calls through `run_forward` and `run_backward`, which keep what they launched
as a plan per input signature, compiled calls through the operators of api.py.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from attention.flash.common import as_bhsd, bounds_of
from attention.flash.hopper import host as hopper, inputs as hopper_inputs
from attention.flash.triton import host as triton
from attention.flash.triton.host import Tiles
from attention.registry import UnsupportedInputError, launches_replayed, why_not

KERNELS = ("auto", "triton")
NO_SOFTCAP = "the Hopper kernels run every variant but softcap, which runs on the Triton kernels"
FUSED = ("fused: dQ added with TMA reductions, in an order that varies (torch.use_deterministic_algorithms(True) for "
         "the bitwise-reproducible kernels)")
DETERMINISTIC = "dK/dV and dQ kernels side by side, bitwise reproducible"


# ----------------------------------------------------------------------------------------------------------
# Which kernels run
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelChoice:
    """The kernels flash runs for one input: "hopper" or "triton" for each pass, and why."""

    forward: str
    backward: str
    forward_reason: str
    backward_reason: str

    def __str__(self) -> str:
        return f"forward {self.forward_reason}; backward {self.backward_reason}"


# Process-wide, not per thread, as graph_replay(): autograd runs the backward on a thread of its own.
_kernels = "auto"


@contextlib.contextmanager
def use_kernels(kernels: str) -> Iterator[None]:
    """Inside: flash runs `kernels`. "triton" keeps the Triton kernels where the Hopper ones would run (to compare
    them, or to rule them out); "auto" (the default) lets choose_kernels pick. Wrap the backward too: it asks again.
    Compiled code reads the setting while it is traced and recompiles when it changes."""
    global _kernels
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    saved, _kernels = _kernels, kernels
    try:
        yield
    finally:
        _kernels = saved


def kernels_in_use() -> str:
    """The use_kernels() setting in effect: "auto" or "triton"."""
    return _kernels


def _forward_problem(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, replayed: bool,
                     kernels: str, capability: Optional[tuple[int, int]] = None, softcap: bool = False,
                     window: Optional[int] = None, docs: bool = False) -> Optional[str]:
    """None when the Hopper forward runs these (batch, heads, seq, d) inputs, else why the Triton one does.
    softcap, window, docs: whether the call caps its scores, its window, whether it packs documents."""
    if kernels == "triton":
        return "use_kernels('triton') is in effect"
    if softcap:
        return NO_SOFTCAP
    return hopper_inputs.forward_problem(q4, k4, v4, causal, replayed, capability, window, docs)


def _backward_problem(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, causal: bool,
                      replayed: bool, kernels: str, capability: Optional[tuple[int, int]] = None,
                      softcap: bool = False, window: Optional[int] = None, docs: bool = False) -> Optional[str]:
    """None when the Hopper backward runs these inputs, else why the Triton one does."""
    if kernels == "triton":
        return "use_kernels('triton') is in effect"
    if softcap:
        return NO_SOFTCAP
    return hopper_inputs.backward_problem(q4, k4, v4, do4, causal, replayed, capability, window, docs)


_SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _reason(problem: Optional[str], pass_name: str, q4: torch.Tensor, causal: bool, replayed: bool,
            window: Optional[int] = None) -> str:
    """"hopper: " and what qualified the input, or "triton: " and the problem."""
    replay = "launches replayed from a CUDA graph"
    if problem is not None:
        return f"triton: {problem}" + (f" ({replay})" if replayed else "")
    b, h, n, d = q4.shape
    fewest = hopper_inputs.min_scores(d, pass_name, replayed)
    bound = f"at least {hopper_inputs.power_of_two(fewest)}" if fewest else "any size"
    scores = hopper_inputs.power_of_two(hopper_inputs.scores(b * h, n, causal, window))
    return f"hopper: sm_90, {_SHORT_DTYPES[q4.dtype]}, d {d}, {scores} scores ({bound}" + (
        f", {replay})" if replayed else ")")


def choose_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, *,
                   do: Optional[torch.Tensor] = None, replayed: Optional[bool] = None, kernels: Optional[str] = None,
                   capability: Optional[tuple[int, int]] = None, window: Optional[int] = None,
                   softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None,
                   deterministic: Optional[bool] = None) -> KernelChoice:
    """The kernels flash runs for these inputs (shaped (..., seq, d_head)), forward and backward, with the reasons.

    do: the backward's upstream gradient (default: one like q, which is what autograd passes for o). replayed:
    whether the launches will be replayed from a CUDA graph (default: inside attention.graph_replay() or a capture).
    kernels: "auto" or "triton" (default: the use_kernels() setting). capability: decide for a GPU of this
    (major, minor), e.g. (9, 0), instead of q's device. window, softcap, doc_ids: the variants of the call (the Hopper
    kernels run all but softcap; the forward of documents and of short windows stays on Triton). deterministic: as
    in deterministic_backward, which with the input decides whether the Hopper backward runs fused. Raises
    UnsupportedInputError when flash cannot run the input.
    """
    reason = why_not("flash", q, k, v, causal, window=window, softcap=softcap, doc_ids=doc_ids)
    if reason is not None:
        raise UnsupportedInputError(f"attention backend 'flash' cannot run this input: {reason}")
    capped, docs = softcap is not None, doc_ids is not None
    q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    do4 = q4 if do is None else as_bhsd(do)
    replayed = launches_replayed() if replayed is None else replayed
    kernels = _kernels if kernels is None else kernels
    forward_ = _forward_problem(q4, k4, v4, causal, replayed, kernels, capability, capped, window, docs)
    backward_ = _backward_problem(q4, k4, v4, do4, causal, replayed, kernels, capability, capped, window, docs)
    backward_reason = _reason(backward_, "backward", q4, causal, replayed, window)
    if backward_ is None:
        backward_reason += "; " + _backward_mode(q4, k4, window, docs, deterministic_backward(deterministic))[1]
    return KernelChoice("triton" if forward_ else "hopper", "triton" if backward_ else "hopper",
                        _reason(forward_, "forward", q4, causal, replayed, window), backward_reason)


def deterministic_backward(deterministic: Optional[bool] = None) -> bool:
    """Whether a call's backward must be bitwise reproducible: its own `deterministic` when given, else
    torch.are_deterministic_algorithms_enabled(), PyTorch's switch. When not, the Hopper backward runs fused where
    that is the faster, without a window or documents (docs/flash.md, Backward modes); every other backward of flash
    is deterministic either way."""
    return torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)


def _backward_mode(q4: torch.Tensor, k4: torch.Tensor, window: Optional[int], docs: bool,
                   deterministic: bool) -> tuple[bool, str]:
    """(whether the Hopper backward runs fused, why) for a call on these (batch, heads, seq, d) inputs with this
    window and documents."""
    b, h, n, d = q4.shape
    kv = k4.shape[1]
    if deterministic:
        fused, why = False, f"{DETERMINISTIC} (deterministic algorithms asked for)"
    else:
        problem = hopper_inputs.fused_backward_problem(b, h, kv, n, d, hopper_inputs.sm_count_of(q4), window, docs)
        fused, why = problem is None, FUSED if problem is None else f"{DETERMINISTIC} ({problem})"
    if hopper_inputs.query_head_programs(h, kv, n, fused):
        least = hopper_inputs.QUERY_HEAD_PROGRAMS_MIN["fused" if fused else "deterministic"]
        why += (f"; a dK/dV program per query head, the heads' shares of dK and dV summed after (GQA groups of "
                f"{least['group']} or more from {least['seq']} keys)")
    return fused, why


def checked_scale(scale: float) -> float:
    """What is left to check of an input the registry validated: the scale."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise UnsupportedInputError(f"flash needs a finite positive scale, got {scale}")
    return scale


# ----------------------------------------------------------------------------------------------------------
# The passes: every call's way to the kernels
# ----------------------------------------------------------------------------------------------------------


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            window: Optional[int] = None, softcap: Optional[float] = None, bounds: Optional[tuple] = None,
            tiles: Optional[Tiles] = None, traceable: bool = False, replayed: Optional[bool] = None,
            kernels: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[object]]:
    """(o, lse, plan) for validated inputs, by the kernels choose_kernels picks: o like q, lse fp32 shaped
    q.shape[:-1], and the plan that repeats the call for inputs of its signature (None where there is none).

    bounds: the documents' (common.bounds_of). tiles: run the Triton forward with this config. traceable: inside a
    triton_op (the Triton launches go through torch.library.wrap_triton, the Hopper one through its own operator).
    replayed, kernels: as in choose_kernels (default: the current state).
    """
    if tiles is None and softcap is None:
        q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
        replayed = launches_replayed() if replayed is None else replayed
        kernels = _kernels if kernels is None else kernels
        if _forward_problem(q4, k4, v4, causal, replayed, kernels, None, False, window, bounds is not None) is None:
            if not traceable and q.dim() <= 4:
                return hopper.planned_forward(q, k, v, causal, scale, window, bounds)
            # Traced, or more than 4 dims (no plan): on the (batch, heads, seq, d) views, outputs in their order.
            run = hopper.forward_op if traceable else hopper.run_forward
            o4, lse4 = run(q4, k4, v4, causal, scale, window, *(bounds or (None, None)))
            return o4.reshape(q.shape), lse4.reshape(q.shape[:-1]), None
    return triton.planned_forward(q, k, v, causal, scale, window, softcap, bounds, tiles, traceable)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
             do: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
             softcap: Optional[float] = None, bounds: Optional[tuple] = None,
             tiles: Optional[dict[str, Tiles]] = None, traceable: bool = False, replayed: Optional[bool] = None,
             kernels: Optional[str] = None, deterministic: Optional[bool] = None) -> tuple:
    """(dq, dk, dv, plan): the gradients by recomputation from lse, each like its input, and the plan that repeats
    the call (None where there is none). tiles ({"dkdv": ..., "dq": ...}): run the Triton backward with these
    configs; deterministic: as in deterministic_backward (default: torch's setting); the rest as in forward."""
    if not tiles and softcap is None:
        q4, k4, v4, do4 = as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(do)
        replayed = launches_replayed() if replayed is None else replayed
        kernels = _kernels if kernels is None else kernels
        if _backward_problem(q4, k4, v4, do4, causal, replayed, kernels, None, False, window,
                             bounds is not None) is None:
            lse = lse.contiguous()  # the kernels index it as (b * h, n_q)
            fused, _ = _backward_mode(q4, k4, window, bounds is not None, deterministic_backward(deterministic))
            if not traceable and q.dim() <= 4:
                return hopper.planned_backward(q, k, v, o, lse, do, causal, scale, window, bounds, fused)
            run = hopper.backward_op if traceable else hopper.run_backward
            grads = run(q4, k4, v4, as_bhsd(o), lse, do4, causal, scale, window, *(bounds or (None, None)), fused)
            return (*(g4.reshape(t.shape) for g4, t in zip(grads, (q, k, v))), None)
    return triton.planned_backward(q, k, v, o, lse, do, causal, scale, window, softcap, bounds, tiles, traceable)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  tiles: Optional[Tiles] = None, traceable: bool = False, replayed: Optional[bool] = None,
                  kernels: Optional[str] = None, window: Optional[int] = None, softcap: Optional[float] = None,
                  doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of forward() for validated inputs, with the call's doc_ids (the variants: attention/registry.py)."""
    o, lse, _ = forward(q, k, v, causal, scale, window, softcap, bounds_of(q, doc_ids), tiles, traceable, replayed,
                        kernels)
    return o, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, causal: bool, scale: float, tiles: Optional[dict[str, Tiles]] = None,
                   traceable: bool = False, replayed: Optional[bool] = None, kernels: Optional[str] = None,
                   window: Optional[int] = None, softcap: Optional[float] = None,
                   doc_ids: Optional[torch.Tensor] = None,
                   deterministic: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of backward(), as flash_forward."""
    dq, dk, dv, _ = backward(q, k, v, o, lse, do, causal, scale, window, softcap, bounds_of(q, doc_ids), tiles,
                             traceable, replayed, kernels, deterministic)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Eager calls: a plan per input signature
# ----------------------------------------------------------------------------------------------------------
# Short eager calls are bound by host time (docs/flash.md, Host time of short sequences). The first call of a
# signature runs forward() and keeps its plan; later calls run the plan: outputs allocated, compiled kernels launched,
# nothing chosen, looked up or built again. The backward does the same per gradient layout.

_MAX_PLANS = 1024  # input signatures kept; past it the cache starts again
_plans: dict[tuple, tuple] = {}  # signature -> (forward plan, {gradient layout -> backward plan})


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               window: Optional[int], softcap: Optional[float], docs: bool) -> tuple:
    """What decides an eager forward's launches: the inputs' shapes, strides, 16-byte alignment (Triton specialises
    on it), dtype and device; the arguments (docs: whether the call packs documents, whose bounds are then (batch,
    seq) int32 whatever the doc_ids); the settings choose_kernels reads; the current device."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
            q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, causal, scale, window, softcap,
            docs, launches_replayed(), _kernels, torch.cuda.current_device() if q.is_cuda else None)


def _keep(cache: dict, key: tuple, value: object) -> None:
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    cache[key] = value


# The last documents' bounds: (weak reference to doc_ids, its version counter, the bounds' shape arguments, bounds).
# A model's layers all get their batch's doc_ids tensor: its bounds are computed once for them all. The weak
# reference lets the entry die with the tensor; an in-place change bumps the version. A CUDA-graph capture computes
# its own, so that its replays recompute the bounds from what the ids hold then.
_last_bounds: Optional[tuple] = None


def _bounds(q: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """bounds_of(q, doc_ids), reused while the same doc_ids tensor comes back unchanged with q's batch and length."""
    global _last_bounds
    if doc_ids is None:
        return None
    if doc_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return bounds_of(q, doc_ids)
    shape = (tuple(q.shape[:-3]), q.shape[-2])
    last = _last_bounds
    if last is not None and last[0]() is doc_ids and last[1] == doc_ids._version and last[2] == shape:
        return last[3]
    bounds = bounds_of(q, doc_ids)
    _last_bounds = (weakref.ref(doc_ids, _forget_bounds), doc_ids._version, shape, bounds)
    return bounds


def _forget_bounds(ref: weakref.ref) -> None:
    global _last_bounds
    if _last_bounds is not None and _last_bounds[0] is ref:
        _last_bounds = None


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                window: Optional[int], softcap: Optional[float], doc_ids: Optional[torch.Tensor]) -> tuple:
    """(o, lse, bounds, backward plans) of an eager call on validated inputs: its signature's plan, or on the first
    call of a signature forward(), whose plan is kept. bounds: the documents', for the backward; backward plans: the
    signature's by gradient layout, None where it has no plan."""
    key = _signature(q, k, v, causal, scale, window, softcap, doc_ids is not None)
    plans = _plans.get(key)
    bounds = _bounds(q, doc_ids)
    if plans is not None:
        o, lse = plans[0](q, k, v, bounds)
        return o, lse, bounds, plans[1]
    o, lse, plan = forward(q, k, v, causal, checked_scale(scale), window, softcap, bounds)
    if plan is None:  # the autotuner launched it (the next call resolves the launch), or more than 4 dims
        return o, lse, bounds, None
    plans = (plan, {})
    _keep(_plans, key, plans)
    return o, lse, bounds, plans[1]


def run_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 do: torch.Tensor, causal: bool, scale: float, window: Optional[int], softcap: Optional[float],
                 bounds: Optional[tuple], plans: Optional[dict],
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of an eager call: the plan of its gradient layout among `plans` (run_forward's), or backward(),
    whose plan is kept there. deterministic: the call's backward mode, resolved (deterministic_backward)."""
    if plans is None:
        return backward(q, k, v, o, lse, do, causal, scale, window, softcap, bounds, deterministic=deterministic)[:3]
    key = (do.stride(), do.dtype, do.data_ptr() % 16 == 0, launches_replayed(), _kernels, deterministic)
    plan = plans.get(key)
    if plan is not None:
        return plan(q, k, v, o, lse, do, bounds)
    dq, dk, dv, plan = backward(q, k, v, o, lse, do, causal, scale, window, softcap, bounds,
                                deterministic=deterministic)
    if plan is not None:
        _keep(plans, key, plan)
    return dq, dk, dv
