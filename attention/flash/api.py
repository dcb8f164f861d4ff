"""The registered `flash` backend: what it can run, and one route to the kernels for eager and compiled calls.

Eager calls go through `FlashAttention`, an autograd.Function: it costs less host time than a torch.library
operator, and short sequences are bound by host time. Compiled calls, and eager calls under a dispatch mode, go
through the operators flash_lm::flash_attn_fwd and flash_lm::flash_attn_bwd. Both reach the kernels through dispatch.forward and
dispatch.backward, which choose them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attention.flash import dispatch
from attention.flash.common import default_scale, empty_like
from attention.flash.triton import host as triton
from attention.registry import VARIANTS, graph_replay_requested, register

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_Y = 65535  # batch * heads goes on CUDA grid axis 1


def environment_problem() -> Optional[str]:
    if not triton.installed():
        return "triton is not installed (pip install triton)"
    if triton.interpreting() or torch.cuda.is_available():
        return None
    return "needs a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors"


def input_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Optional[str]:
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


class FlashAttention(torch.autograd.Function):
    """`FlashAttention.apply(q, k, v, causal=False, scale=None, window=None, softcap=None, doc_ids=None,
    deterministic=None)` on (..., seq, d_head) inputs that get_attention("flash") accepts (it does not check them
    again; the scale it does). deterministic: this call's backward mode (dispatch.deterministic_backward; default:
    torch.use_deterministic_algorithms), fixed when the forward runs.

    What the registered backend runs eagerly. It saves q, k, v, O and the logsumexp L, the only saved tensor shaped
    q.shape[:-1] (the CS336 harness finds it that way); doc_ids too, so that autograd refuses a backward after an
    in-place change. Each input signature runs its plan once it has one (dispatch.run_forward).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, window=None, softcap=None, doc_ids=None, deterministic=None):
        if scale is None:
            scale = default_scale(q, None)
        o, lse, ctx.bounds, ctx.backward_plans = dispatch.run_forward(q, k, v, causal, scale, window, softcap,
                                                                      doc_ids)
        ctx.save_for_backward(q, k, v, o, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, float(scale), window, softcap
        ctx.deterministic = dispatch.deterministic_backward(deterministic)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *_ = ctx.saved_tensors
        dq, dk, dv = dispatch.run_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.window, ctx.softcap,
                                           ctx.bounds, ctx.backward_plans, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The operators compiled code calls. Dynamo cannot trace the autotuner and the plans. On the GPU they are
# triton_ops: Inductor sees the Triton kernels inside and launches them from its own code (an opaque operator costs
# a Python dispatch and Triton's launcher per call), and the backward joins the compiled backward graph. In the CPU
# interpreter, where torch.library.wrap_triton hands the kernels back unwrapped, opaque custom_ops.
# ----------------------------------------------------------------------------------------------------------


def _operators(traceable: bool):
    """flash_lm::flash_attn_fwd and flash_lm::flash_attn_bwd, triton_ops if traceable else custom_ops, with autograd
    registered."""
    define = torch.library.triton_op if traceable else torch.library.custom_op

    @define("flash_lm::flash_attn_fwd", mutates_args=())
    def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, replayed: bool,
                   kernels: str, window: Optional[int] = None, softcap: Optional[float] = None,
                   doc_ids: Optional[torch.Tensor] = None,
                   deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of validated inputs: o like q (its memory order up to 4 dims), lse fp32 shaped q.shape[:-1]."""
        return dispatch.flash_forward(q, k, v, causal, scale, traceable=traceable, replayed=replayed,
                                      kernels=kernels, window=window, softcap=softcap, doc_ids=doc_ids)

    @define("flash_lm::flash_attn_bwd", mutates_args=())
    def backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor, causal: bool, scale: float, replayed: bool, kernels: str,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    doc_ids: Optional[torch.Tensor] = None,
                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv), each shaped like its input (and in its memory order up to 4 dims)."""
        return dispatch.flash_backward(q, k, v, o, lse, do, causal, scale, traceable=traceable, replayed=replayed,
                                       kernels=kernels, window=window, softcap=softcap, doc_ids=doc_ids,
                                       deterministic=deterministic)

    if not traceable:  # a triton_op's output shapes come from tracing its body; a custom_op's from these
        forward_op.register_fake(lambda q, k, v, causal, scale, replayed, kernels, window=None, softcap=None,
                                 doc_ids=None, deterministic=False: (empty_like(q),
                                                                     q.new_empty(q.shape[:-1], dtype=torch.float32)))
        backward_op.register_fake(lambda q, k, v, o, lse, do, causal, scale, replayed, kernels, window=None,
                                  softcap=None, doc_ids=None, deterministic=False: (empty_like(q), empty_like(k),
                                                                                    empty_like(v)))

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, causal, scale, replayed, kernels, window, softcap, doc_ids, deterministic = inputs
        o, lse = output
        # As FlashAttention: q, k, v, o and lse saved; doc_ids too.
        ctx.save_for_backward(q, k, v, o, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.causal, ctx.scale, ctx.replayed, ctx.kernels = causal, scale, replayed, kernels
        ctx.window, ctx.softcap, ctx.deterministic = window, softcap, deterministic

    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *doc_ids = ctx.saved_tensors
        dq, dk, dv = backward_op(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.replayed, ctx.kernels, ctx.window,
                                 ctx.softcap, doc_ids[0] if doc_ids else None, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op, backward_op


flash_op, flash_backward_op = _operators(traceable=not triton.interpreting())


@register(
    "flash",
    description="FlashAttention-2 in Triton (fused forward and backward, O(seq) memory)",
    environment_check=environment_problem,
    input_check=input_problem,
    variants=tuple(VARIANTS),
)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        # Read while tracing, so the compiled code guards on them; a capture in progress cannot be asked here. A
        # dispatch mode (selective activation checkpointing's) sees the operator, where the Function hides its inside.
        return flash_op(q, k, v, causal, dispatch.checked_scale(scale), graph_replay_requested(),
                        dispatch.kernels_in_use(), window, softcap, doc_ids, dispatch.deterministic_backward())[0]
    if window is None and softcap is None and doc_ids is None:  # fewer arguments: less host time in apply()
        return FlashAttention.apply(q, k, v, causal, scale)
    return FlashAttention.apply(q, k, v, causal, scale, window, softcap, doc_ids)
