"""`flash`: FlashAttention-2 with a fused forward and backward, and O(seq) memory (docs/flash.md).

Two sets of kernels compute it: Triton kernels that run every input (triton.py, triton_kernels.py), and Gluon
kernels for Hopper GPUs that run the inputs they support faster (hopper.py, hopper_kernels.py). `choose_kernels`
decides between them, for the forward and the backward, and says why; the launches ask it, so what it says is what
runs. `use_kernels("triton")` forces the Triton kernels. `flash-torch` (reference.py) is the readable specification.
The variants (attention/registry.py) run on both, except softcap (Triton only).

    from attention.flash import FlashAttentionTriton, FlashAttentionTorch, choose_kernels, use_kernels
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from attention.flash.hopper import host as hopper, inputs as hopper_inputs
from attention.flash.triton import host as triton
from attention.flash.common import as_bhsd, attention_function, bounds_of, default_scale, empty_like
from attention.flash.triton.host import Tiles
from attention.registry import (VARIANTS, UnsupportedInputError, graph_replay_requested,
                                launches_replayed, register, validate_qkv, validate_variant)

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_Y = 65535  # batch * heads goes on CUDA grid axis 1
KERNELS = ("auto", "triton")


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


NO_SOFTCAP = "the Hopper kernels run every variant but softcap, which runs on the Triton kernels"


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
                   softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None) -> KernelChoice:
    """The kernels flash runs for these inputs (shaped (..., seq, d_head)), forward and backward, with the reasons.

    do: the backward's upstream gradient (default: one like q, which is what autograd passes for o). replayed:
    whether the launches will be replayed from a CUDA graph (default: inside attention.graph_replay() or a capture).
    kernels: "auto" or "triton" (default: the use_kernels() setting). capability: decide for a GPU of this
    (major, minor), e.g. (9, 0), instead of q's device. window, softcap, doc_ids: the variants of the call (the Hopper
    kernels run all but softcap; the forward of documents and of short windows stays on Triton). Raises
    UnsupportedInputError when flash cannot run the input.
    """
    _check(q, k, v, causal, None, window, softcap, doc_ids)
    capped = softcap is not None
    q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
    do4 = q4 if do is None else as_bhsd(do)
    replayed = launches_replayed() if replayed is None else replayed
    kernels = kernels_in_use() if kernels is None else kernels
    forward = _forward_problem(q4, k4, v4, causal, replayed, kernels, capability, capped, window, doc_ids is not None)
    backward = _backward_problem(q4, k4, v4, do4, causal, replayed, kernels, capability, capped, window,
                                 doc_ids is not None)
    return KernelChoice("triton" if forward else "hopper", "triton" if backward else "hopper",
                        _reason(forward, "forward", q4, causal, replayed, window),
                        _reason(backward, "backward", q4, causal, replayed, window))


# ----------------------------------------------------------------------------------------------------------
# The passes
# ----------------------------------------------------------------------------------------------------------


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  tiles: Optional[Tiles] = None, traceable: bool = False, replayed: Optional[bool] = None,
                  kernels: Optional[str] = None, window: Optional[int] = None, softcap: Optional[float] = None,
                  doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for validated inputs: o like q, lse fp32 of shape q.shape[:-1], by the kernels choose_kernels picks.

    tiles: run the Triton forward with this config. traceable: inside a triton_op (the Triton launches go through
    torch.library.wrap_triton, the Hopper one through its own operator). replayed, kernels: as in choose_kernels.
    window, softcap, doc_ids: the variants (attention/registry.py); softcap on the Triton kernels.
    """
    if tiles is None and softcap is None:
        q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
        replayed = launches_replayed() if replayed is None else replayed
        kernels = kernels_in_use() if kernels is None else kernels
        if _forward_problem(q4, k4, v4, causal, replayed, kernels, None, False, window, doc_ids is not None) is None:
            masks = hopper.Masks.of(q, window, doc_ids)
            run = hopper_forward_op if traceable else hopper.run_forward
            o4, lse4 = run(q4, k4, v4, causal, scale, masks.window, masks.starts, masks.ends)
            return o4.reshape(q.shape), lse4.reshape(q.shape[:-1])
    return triton.forward(q, k, v, causal, scale, tiles, traceable, window, softcap, doc_ids)


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, causal: bool, scale: float, tiles: Optional[dict[str, Tiles]] = None,
                   traceable: bool = False, replayed: Optional[bool] = None, kernels: Optional[str] = None,
                   window: Optional[int] = None, softcap: Optional[float] = None,
                   doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by recomputation from lse, each like its input. tiles ({"dkdv": ..., "dq": ...}): run the Triton
    backward with these configs; the rest as in flash_forward."""
    if not tiles and softcap is None:
        q4, k4, v4, o4, do4 = (as_bhsd(t) for t in (q, k, v, o, do))
        replayed = launches_replayed() if replayed is None else replayed
        kernels = kernels_in_use() if kernels is None else kernels
        if _backward_problem(q4, k4, v4, do4, causal, replayed, kernels, None, False, window,
                             doc_ids is not None) is None:
            lse = lse.contiguous()  # the kernels index it as (b * h, n_q)
            masks = hopper.Masks.of(q, window, doc_ids)
            run = hopper_backward_op if traceable else hopper.run_backward
            grads = run(q4, k4, v4, o4, lse, do4, causal, scale, masks.window, masks.starts, masks.ends)
            return tuple(g4.reshape(t.shape) for g4, t in zip(grads, (q, k, v)))
    return triton.backward(q, k, v, o, lse, do, causal, scale, tiles, traceable, window, softcap, doc_ids)


# ----------------------------------------------------------------------------------------------------------
# Checks and the backend
# ----------------------------------------------------------------------------------------------------------


def _environment_problem() -> Optional[str]:
    if not triton.installed():
        return "triton is not installed (pip install triton)"
    if triton.interpreting() or torch.cuda.is_available():
        return None
    return "needs a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors"


def _input_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Optional[str]:
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"head dim {d} is not supported: flash needs {MIN_HEAD_DIM} <= d_head <= {MAX_HEAD_DIM}"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported: flash needs float16, bfloat16 or float32"
    if q.device.type == "cpu" and not triton.interpreting():
        return "CPU tensors need TRITON_INTERPRET=1 (set before the kernels load); otherwise pass CUDA tensors"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} is not supported: flash needs CUDA (or CPU with TRITON_INTERPRET=1)"
    if math.prod(q.shape[:-2]) > MAX_GRID_Y:
        return f"the product of the leading dims is {math.prod(q.shape[:-2])}; flash supports at most {MAX_GRID_Y}"
    return None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
           window: Optional[int] = None, softcap: Optional[float] = None,
           doc_ids: Optional[torch.Tensor] = None) -> float:
    """Raise UnsupportedInputError before any launch; return the resolved scale."""
    validate_qkv(q, k, v, causal, allow_gqa=True)
    validate_variant(q, k, causal, window, softcap, doc_ids)
    reason = _environment_problem() or _input_problem(q, k, v, causal)
    if reason is not None:
        raise UnsupportedInputError(f"attention backend 'flash' cannot run this input: {reason}")
    return _scale_check(q, k, v, causal, default_scale(q, scale))


def _scale_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 window: Optional[int] = None, softcap: Optional[float] = None,
                 doc_ids: Optional[torch.Tensor] = None) -> float:
    """What is left to check of an input the registry validated: the scale."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise UnsupportedInputError(f"flash needs a finite positive scale, got {scale}")
    return scale


FlashAttentionTriton = attention_function(
    "FlashAttentionTriton",
    "`FlashAttentionTriton.apply(q, k, v, is_causal=False, scale=None, window=None, softcap=None, doc_ids=None)` on "
    "(..., seq, d_head).",
    _check, flash_forward, flash_backward)


# ----------------------------------------------------------------------------------------------------------
# What the registry's "flash" runs eagerly
# ----------------------------------------------------------------------------------------------------------
# Short sequences called from eager Python are bound by host time (docs/flash.md, Host time of short sequences). The
# first eager call of an input signature chooses its kernels and keeps what it launched as a plan (triton.ForwardPlan
# or hopper.ForwardPlan); later calls of the signature run the plan: they allocate the outputs and launch the compiled
# kernels, without choosing kernels again, looking tiles up or building arguments and descriptors. The backward does
# the same per gradient layout. Documents' bounds are computed once per forward, passed to its launches and kept for
# its backward's.

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
# Every layer of a model's forward gets its batch's doc_ids tensor, and the bounds (two searchsorted calls and a
# copy, about 0.15 ms of host time on the H100's host) are computed once for them all. The reference is weak, so the
# entry dies with the tensor (its memory cannot be reused under a live entry); an in-place change bumps the version.
# A CUDA-graph capture computes its own: its replays must recompute the bounds from what the ids hold then.
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


class _RegisteredFlash(torch.autograd.Function):
    """FlashAttentionTriton for inputs the registry checked (the scale is left to check), running each input
    signature's plan once it has one."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window=None, softcap=None, doc_ids=None):
        docs = doc_ids is not None
        key = _signature(q, k, v, causal, scale, window, softcap, docs)
        plans = _plans.get(key)
        bounds = _bounds(q, doc_ids)
        if plans is not None:
            o, lse = plans[0](q, k, v, bounds)
        else:  # the first call of this signature
            scale = _scale_check(q, k, v, causal, scale)
            q4, k4, v4 = as_bhsd(q), as_bhsd(k), as_bhsd(v)
            if _forward_problem(q4, k4, v4, causal, launches_replayed(), _kernels, None, softcap is not None, window,
                                docs) is None:
                o, lse, plan = hopper.planned_forward(q, k, v, causal, scale, window, bounds)
            else:
                o, lse, plan = triton.planned_forward(q, k, v, causal, scale, window, softcap, bounds)
            if plan is not None:  # None: the autotuner launched it (the next call resolves the launch), or > 4 dims
                plans = (plan, {})
                _keep(_plans, key, plans)
        # As FlashAttentionTriton: q, k, v, o and lse saved; doc_ids too, so autograd refuses a backward after it
        # was changed in place. The backward's launches take the forward's document bounds.
        ctx.save_for_backward(q, k, v, o, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, float(scale), window, softcap  # a plan's scale too
        ctx.bounds, ctx.backward_plans = bounds, None if plans is None else plans[1]
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *doc_ids = ctx.saved_tensors
        causal, scale, window, softcap = ctx.causal, ctx.scale, ctx.window, ctx.softcap
        plans, bounds = ctx.backward_plans, ctx.bounds
        if plans is not None:
            key = (do.stride(), do.dtype, do.data_ptr() % 16 == 0, launches_replayed(), _kernels)
            plan = plans.get(key)
            if plan is not None:
                return (*plan(q, k, v, o, lse, do, bounds), None, None, None, None, None)
            # The first backward of this signature and gradient layout.
            q4, k4, v4, do4 = as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(do)
            if _backward_problem(q4, k4, v4, do4, causal, launches_replayed(), _kernels, None, softcap is not None,
                                 window, bounds is not None) is None:
                dq, dk, dv, plan = hopper.planned_backward(q, k, v, o, lse, do, causal, scale, window, bounds)
            else:
                dq, dk, dv, plan = triton.planned_backward(q, k, v, o, lse, do, causal, scale, window, softcap,
                                                           bounds)
            if plan is not None:
                _keep(plans, key, plan)
            return dq, dk, dv, None, None, None, None, None
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, causal, scale, window=window, softcap=softcap,
                                    doc_ids=doc_ids[0] if doc_ids else None)
        return dq, dk, dv, None, None, None, None, None


@register(
    "flash",
    description="FlashAttention-2 in Triton (fused forward and backward, O(seq) memory)",
    environment_check=_environment_problem,
    input_check=_input_problem,
    variants=tuple(VARIANTS),
)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # the check runs while tracing, not on every call of the compiled code
        op = flash_opaque_op if triton.interpreting() else flash_op
        # Read while tracing, so the compiled code guards on them; a capture in progress cannot be asked here.
        return op(q, k, v, causal, _check(q, k, v, causal, scale, window, softcap, doc_ids),
                  graph_replay_requested(), kernels_in_use(), window, softcap, doc_ids)[0]
    # Eager: an autograd.Function, whose host time per forward+backward measured 0.78 ms against the custom op's
    # 1.18 ms on the H100 at B4 H20 N1024; short sequences are bound by host time.
    if window is None and softcap is None and doc_ids is None:  # fewer arguments: less host time in apply()
        return _RegisteredFlash.apply(q, k, v, causal, scale)
    return _RegisteredFlash.apply(q, k, v, causal, scale, window, softcap, doc_ids)


# ----------------------------------------------------------------------------------------------------------
# torch.library operators: what the registry's "flash" runs under torch.compile
# ----------------------------------------------------------------------------------------------------------
# Without them, Dynamo traces into the triton.autotune wrapper and its pruning hook, and Inductor fails to compile
# them. On the GPU: triton_op, which lets the compiler see the Triton kernels inside. Inductor launches them from
# its generated code with its own launcher, as it does its own kernels, and the backward joins the compiled backward
# graph. An opaque custom op instead costs a Python dispatch and Triton's launcher per call: with it, a compiled
# `small` model trained 30% slower with flash than with sdpa on the H100.
# In the CPU interpreter: custom_op. The compiler cannot trace interpreted kernels (torch.library.wrap_triton hands
# them back unwrapped), so it gets one opaque op with known output shapes.
# The Hopper kernels are Gluon kernels launched by their own host code: inside a triton_op each pass is an opaque
# operator of its own. All paths save the same tensors and run the same kernels.


def _operator_pair(suffix: str, traceable: bool):
    """The forward and backward operators flash_lm::flash_attn_{fwd,bwd}{suffix}, with autograd registered."""
    define = torch.library.triton_op if traceable else torch.library.custom_op

    @define(f"flash_lm::flash_attn_fwd{suffix}", mutates_args=())
    def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, replayed: bool,
                   kernels: str, window: Optional[int] = None, softcap: Optional[float] = None,
                   doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of validated inputs: o like q (its memory order up to 4 dims), lse fp32 shaped q.shape[:-1]."""
        return flash_forward(q, k, v, causal, scale, traceable=traceable, replayed=replayed, kernels=kernels,
                             window=window, softcap=softcap, doc_ids=doc_ids)

    @define(f"flash_lm::flash_attn_bwd{suffix}", mutates_args=())
    def backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor, causal: bool, scale: float, replayed: bool, kernels: str,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv), each shaped like its input (and in its memory order up to 4 dims)."""
        return flash_backward(q, k, v, o, lse, do, causal, scale, traceable=traceable, replayed=replayed,
                              kernels=kernels, window=window, softcap=softcap, doc_ids=doc_ids)

    if not traceable:  # a triton_op's output shapes come from tracing its body; a custom_op's from these
        forward_op.register_fake(lambda q, k, v, causal, scale, replayed, kernels, window=None, softcap=None,
                                 doc_ids=None: (empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)))
        backward_op.register_fake(lambda q, k, v, o, lse, do, causal, scale, replayed, kernels, window=None,
                                  softcap=None, doc_ids=None: (empty_like(q), empty_like(k), empty_like(v)))

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, causal, scale, replayed, kernels, window, softcap, doc_ids = inputs
        o, lse = output
        # As FlashAttentionTriton: O(seq) memory, lse the only (..., seq); doc_ids (batch, seq) integers if given.
        ctx.save_for_backward(q, k, v, o, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.causal, ctx.scale, ctx.replayed, ctx.kernels = causal, scale, replayed, kernels
        ctx.window, ctx.softcap = window, softcap

    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *doc_ids = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.replayed, ctx.kernels, ctx.window,
                                 ctx.softcap, doc_ids[0] if doc_ids else None)
        return dq, dk, dv, None, None, None, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op, backward_op


flash_op, flash_backward_op = _operator_pair("", traceable=True)
flash_opaque_op, flash_backward_opaque_op = _operator_pair("_opaque", traceable=False)


@torch.library.custom_op("flash_lm::flash_attn_fwd_hopper", mutates_args=())
def hopper_forward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, scale: float,
                      window: Optional[int] = None, starts: Optional[torch.Tensor] = None,
                      ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of (batch, heads, seq, d) inputs that hopper_inputs.forward_problem accepted; window, starts, ends: the
    hopper.Masks fields."""
    return hopper.run_forward(q4, k4, v4, causal, scale, window, starts, ends)


@hopper_forward_op.register_fake
def _(q4, k4, v4, causal, scale, window=None, starts=None, ends=None):
    return empty_like(q4), q4.new_empty(q4.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash_lm::flash_attn_bwd_hopper", mutates_args=())
def hopper_backward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                       do4: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
                       starts: Optional[torch.Tensor] = None,
                       ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of (batch, heads, seq, d) inputs that hopper_inputs.backward_problem accepted; window, starts, ends: the
    hopper.Masks fields."""
    return hopper.run_backward(q4, k4, v4, o4, lse, do4, causal, scale, window, starts, ends)


@hopper_backward_op.register_fake
def _(q4, k4, v4, o4, lse, do4, causal, scale, window=None, starts=None, ends=None):
    return empty_like(q4), empty_like(k4), empty_like(v4)


# Registered after "flash", so list_attention() shows the kernel before its specification.
from attention.flash.reference import FlashAttentionTorch  # noqa: E402
from attention.flash.decode import host as decode  # noqa: E402,F401  (the decode paths of flash and flash-torch)

__all__ = ["FlashAttentionTorch", "FlashAttentionTriton", "KernelChoice", "Tiles", "choose_kernels",
           "flash_backward", "flash_forward", "kernels_in_use", "use_kernels"]
