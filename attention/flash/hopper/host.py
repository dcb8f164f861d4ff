"""Host side of flash's Hopper kernels (kernels.py): descriptors, launches, and the plans eager calls repeat. Which
inputs they take is in inputs.py, their tiles in tiles.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from attention.flash.common import as_bhsd, bounds_of, empty, empty_like, on_device_of, sm_count
from attention.flash.hopper.inputs import query_head_programs, rows_index
from attention.flash.hopper.tiles import FUSED_REGS, HopperTiles, backward_tiles_for, fused_dq_cols, tiles_for
from attention.flash.triton.host import Launch, delta_and_launch, dq_from_accumulator, plannable, work_order


def rows_view(t: torch.Tensor) -> Optional[tuple[torch.Tensor, int, int, int]]:
    """(2-D view, rows per batch, rows per head, columns per head) of t, as rows_index describes it, or None."""
    index = rows_index(t)
    if index is None:
        return None
    rows_b, rows_h, cols_h, (rows, cols) = index
    return torch.as_strided(t, (rows, cols), (cols, 1)), rows_b, rows_h, cols_h


@functools.cache
def _shared_layout(block_rows: int, d: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a block_rows x d tile (computing it costs ~7 us of host time per call)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([block_rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t: torch.Tensor, block_rows: int):
    """A TMA descriptor of t's 2-D view (rows_view) in blocks of block_rows x d, and the view's index."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    view, rows_b, rows_h, cols_h = rows_view(t)
    d = t.shape[-1]
    return TensorDescriptor.from_tensor(view, [block_rows, d], _shared_layout(block_rows, d, t.dtype)), \
        (rows_b, rows_h, cols_h)


def _row_stats_descriptor(stats: torch.Tensor, block: int):
    """A 1-D TMA descriptor over a contiguous fp32 (batch * heads, seq) L or delta, in blocks of `block` rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not stats.is_contiguous() or stats.dtype != torch.float32:
        raise ValueError(f"L and delta must be contiguous float32, got {stats.dtype} with strides {stats.stride()}")
    return TensorDescriptor.from_tensor(stats.view(-1), [block], _stats_layout())


@functools.cache
def _stats_layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _output_descriptor(out: torch.Tensor, input_index: tuple[int, int, int], block_rows: int):
    """A descriptor for an output, which must be in the memory order of the input whose view index is given."""
    desc, index = _descriptor(out, block_rows)
    if index != input_index:
        raise ValueError("an output must be in its input's memory order")
    return desc


def _meta(t: HopperTiles, causal: bool, group: int = 1, window: bool = False, docs: bool = False) -> dict:
    """The compile-time arguments every Hopper kernel takes; each consumer is one warpgroup of 4 warps. group: query
    heads per key/value head (GQA); window, docs: whether a window or documents mask the scores."""
    return dict(CAUSAL=causal, WINDOW=window, DOCS=docs, GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                STAGES=t.stages, NUM_CONSUMERS=t.consumers, CONSUMER_REGS=t.consumer_regs, num_warps=4)


def fused_meta(t: HopperTiles, d: int, dtype: torch.dtype) -> dict:
    """The compile-time arguments that make the dK/dV kernel the fused backward (tiles t, inputs of head dim d and
    dtype): on top of _meta's, its dS^T layout and, with a dQ warpgroup (fused_dq_cols), the registers of FUSED_REGS."""
    consumer_regs, dq_regs = FUSED_REGS if fused_dq_cols(d, t.consumers) == d else (t.consumer_regs, 0)
    return dict(FUSED=True, DS_LAYOUT=_shared_layout(t.block_m, t.block_n, dtype), CONSUMER_REGS=consumer_regs,
                DQ_REGS=dq_regs)


@dataclass(frozen=True)
class Masks:
    """What masks the scores beyond causal: a window of `window` keys, documents bounded by `starts` and `ends`
    (int32 (batch, seq), attention.masks.doc_bounds: the positions [start, end) of each position's document)."""

    window: Optional[int] = None
    starts: Optional[torch.Tensor] = None
    ends: Optional[torch.Tensor] = None

    @staticmethod
    def of(q: torch.Tensor, window: Optional[int], doc_ids: Optional[torch.Tensor]) -> "Masks":
        """The masks of a call with these registry arguments; q (..., heads, seq, d) as the registry takes it, its
        leading dims flattened to the batch as as_bhsd does."""
        return Masks(window, *(bounds_of(q, doc_ids) or ()))

    def arguments(self, dummy: torch.Tensor) -> tuple:
        """(START, END, window) as the kernels take them; `dummy` stands for absent bounds (never read)."""
        if self.starts is None:
            return dummy, dummy, self.window or 0
        return self.starts, self.ends, self.window or 0

    def constexprs(self) -> dict:
        return dict(window=self.window is not None, docs=self.starts is not None)


NO_MASKS = Masks()


@dataclass(frozen=True)
class ItemOrder:
    """The order in which the persistent forward takes its work items with documents (triton/host.py's work_order),
    resolved: `order(starts, ends)` ranks them for a call's document bounds."""

    launch: Launch
    shape: tuple[int, ...]

    def __call__(self, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        order = empty(self.shape, torch.int32, starts.device)
        self.launch(starts, ends, order)
        return order


def _check_tiles(n: int, t: HopperTiles) -> None:
    if n % t.block_m or n % t.block_n:
        raise ValueError(f"sequence length {n} is not a multiple of the tiles {t.block_m} and {t.block_n}")


def _launch_of(jit_fn, kernel, grid: tuple[int, int], args: tuple, n_tensors: int, meta: dict) -> Launch:
    """The Launch of a kernel the JIT has just launched: its compiled kernel for the grid, the arguments after the
    first n_tensors, and the constants in signature order."""
    return Launch(kernel[(*grid, 1)], (*args[n_tensors:], *(meta[name] for name in jit_fn.arg_names[len(args):])))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
            scale: float, tiles: Optional[HopperTiles] = None,
            masks: Masks = NO_MASKS) -> tuple[Launch, tuple, Optional[ItemOrder]]:
    """Write o (q's memory order) and lse ((batch * heads, seq) fp32, natural log) for accepted inputs; k and v may
    have fewer heads than q (GQA: a divisor of q's). Returns the launch resolved, its descriptors of q, k, v, o and,
    for documents on the persistent grid, the order of its work items (see ForwardPlan)."""
    import triton

    from attention.flash.hopper.kernels import attn_fwd_hopper

    b, h, n, d = q.shape
    t = tiles or tiles_for(d, n, b * h, sm_count(q.device.index or 0), masks.window, masks.starts is not None,
                           causal)
    _check_tiles(n, t)
    q_desc, q_index = _descriptor(q, t.block_m)
    k_desc, k_index = _descriptor(k, t.block_n)
    v_desc, v_index = _descriptor(v, t.block_n)
    starts, ends, window = masks.arguments(lse)
    order, item_order = lse, None  # read by persistent programs with documents only (kernels._work_item)
    if t.persistent and masks.starts is not None:
        order, launch = work_order(starts, ends, n, t.rows, t.block_n, causal, masks.window)
        item_order = ItemOrder(launch, tuple(order.shape))
    descs = (q_desc, k_desc, v_desc, _output_descriptor(o, q_index, t.block_m))
    items = (triton.cdiv(n, t.rows), b * h)
    grid = (min(items[0] * items[1], sm_count(q.device.index or 0)), 1) if t.persistent else items
    args = (*descs, lse, starts, ends, order, *q_index, *k_index, *v_index, h, n, b * h, window,
            scale * math.log2(math.e))
    meta = dict(_meta(t, causal, h // k.shape[1], **masks.constexprs()), PERSISTENT=t.persistent)
    launch = _launch_of(attn_fwd_hopper, attn_fwd_hopper[grid](*args, **meta), grid, args, 8, meta)
    return launch, descs, item_order


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
             tiles: Optional[dict[str, HopperTiles]] = None, masks: Masks = NO_MASKS,
             dq_acc: Optional[torch.Tensor] = None) -> tuple:
    """Write dq, dk, dv (each in its input's memory order) for inputs backward_problem accepted; k and v may have
    fewer heads than q (GQA). Returns the launches resolved with their descriptors: (dK/dV launch, its descriptors
    of q, k, v, dO, dK, dV, L, delta and dQ's accumulator; dQ launch, its descriptors of q, k, v, dO, dQ) (see
    BackwardPlan).

    dq_acc: run the fused backward (no window or documents): its dK/dV kernel adds dQ into this zeroed fp32
    accumulator of accumulator_shape(q) (delta_and_launch zeroes it), in an order that varies; its dQ launch is then
    dq_from_accumulator's, with no descriptors. Either way, where the dK/dV kernel runs a program per query head
    (share_shape), the heads' shares of dK and dV are summed into dk and dv after it.

    lse and delta are (batch * heads, seq) fp32: the forward's natural-log logsumexp and rowsum(dO * O).
    """
    b, h, n, d = q.shape
    tiles = {**backward_tiles_for(d, n, b * h, sm_count(q.device.index or 0), dq_acc is not None), **(tiles or {})}
    shares = empty_shares(share_shape(q, k, fused=dq_acc is not None), q)
    dkdv_out = shares or (dk, dv)
    if dq_acc is not None:
        dkdv = backward_dkdv(q, k, v, do, lse, delta, *dkdv_out, causal, scale, tiles["dkdv"], masks, dq_acc)
        resolved = (*dkdv, dq_from_accumulator(dq_acc, dq, scale), ())
    else:
        dkdv, dq_pass = _side_by_side(
            q.device.index or 0,
            lambda: backward_dkdv(q, k, v, do, lse, delta, *dkdv_out, causal, scale, tiles["dkdv"], masks),
            lambda: backward_dq(q, k, v, do, lse, delta, dq, causal, scale, tiles["dq"], masks))
        resolved = (*dkdv, *dq_pass)
    if shares is not None:
        sum_shares(shares, dk, dv)
    return resolved


def _side_by_side(device_index: int, dkdv: Callable[[], Any], dq: Callable[[], Any]) -> tuple[Any, Any]:
    """(dkdv(), dq()): the dK/dV launch on the current stream and the dQ launch on a second one beside it.

    The two kernels are independent: dQ's programs take the SMs that dK/dV's last wave leaves idle instead of waiting
    for the whole kernel to drain (docs/flash.md, Hopper kernels)."""
    main = torch.cuda.current_stream(device_index)
    side, inputs_ready, dq_done = _side_stream(device_index)
    inputs_ready.record(main)  # the inputs, delta included, are written on main
    side.wait_event(inputs_ready)
    first = dkdv()
    torch.cuda.set_stream(side)
    try:
        second = dq()
    finally:
        torch.cuda.set_stream(main)
    # Main waits for dQ before anything later runs, so no tensor the dQ kernel touches is freed or reused under it.
    dq_done.record(side)
    main.wait_event(dq_done)
    return first, second


def run_forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, scale: float,
                window: Optional[int] = None, starts: Optional[torch.Tensor] = None,
                ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of (batch, heads, seq, d) inputs that forward_problem accepted: o in q's memory order, lse fp32.
    window, starts, ends: the Masks fields."""
    return _forward_call(q4, k4, v4, causal, scale, Masks(window, starts, ends))[:2]


def run_backward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                 do4: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
                 starts: Optional[torch.Tensor] = None, ends: Optional[torch.Tensor] = None,
                 fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of (batch, heads, seq, d) inputs that backward_problem accepted, after Triton's delta pre-pass;
    fused: run the fused backward (see backward)."""
    return _backward_call(q4, k4, v4, o4, lse, do4, causal, scale, Masks(window, starts, ends), fused)[:3]



# Traced code (a triton_op's body) cannot look into Gluon launches: there each Hopper pass is an opaque operator.
@torch.library.custom_op("flash_lm::flash_attn_fwd_hopper", mutates_args=())
def forward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, scale: float,
               window: Optional[int] = None, starts: Optional[torch.Tensor] = None,
               ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """run_forward as an operator."""
    return run_forward(q4, k4, v4, causal, scale, window, starts, ends)


@forward_op.register_fake
def _(q4, k4, v4, causal, scale, window=None, starts=None, ends=None):
    return empty_like(q4), q4.new_empty(q4.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash_lm::flash_attn_bwd_hopper", mutates_args=())
def backward_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                do4: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
                starts: Optional[torch.Tensor] = None, ends: Optional[torch.Tensor] = None,
                fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """run_backward as an operator."""
    return run_backward(q4, k4, v4, o4, lse, do4, causal, scale, window, starts, ends, fused)


@backward_op.register_fake
def _(q4, k4, v4, o4, lse, do4, causal, scale, window=None, starts=None, ends=None, fused=False):
    return empty_like(q4), empty_like(k4), empty_like(v4)


def _forward_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  masks: Masks) -> tuple:
    """(o, lse, launch, descriptors, item order) of forward() on inputs shaped as the registry takes them, or (b, h,
    s, d)."""
    o = empty_like(q)
    lse = empty(tuple(q.shape[:-1]), torch.float32, q.device)
    with on_device_of(q):
        launch, descs, item_order = forward(as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(o), lse, causal, scale,
                                            masks=masks)
    return o, lse, launch, descs, item_order


def _backward_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, causal: bool, scale: float, masks: Masks, fused: bool = False) -> tuple:
    """(dq, dk, dv, delta, delta launch, backward()'s launches and descriptors), as _forward_call; fused: run the fused
    backward, whose accumulator the delta launch zeroes."""
    q4, k4, v4, o4, do4 = (as_bhsd(t) for t in (q, k, v, o, do))
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    acc = empty(accumulator_shape(q4), torch.float32, q.device) if fused else None
    with on_device_of(q):
        delta, delta_launch = delta_and_launch(o4, do4, acc)
        resolved = backward(q4, k4, v4, do4, lse, delta, as_bhsd(dq), as_bhsd(dk), as_bhsd(dv), causal, scale,
                            masks=masks, dq_acc=acc)
    return dq, dk, dv, delta, delta_launch, resolved


# ----------------------------------------------------------------------------------------------------------
# Plans: a Hopper forward or backward resolved for one input signature (triton/host.py's plans say why)
# ----------------------------------------------------------------------------------------------------------
# Building a Hopper backward's 13 TMA descriptors and binding its launches through Triton's JIT costs more host time
# than a short call's kernels take. A plan keeps the compiled kernels and the descriptors: each call points the
# descriptors at its tensors (the launch encodes a descriptor when it is made, so the objects can be reused; the
# signature fixes everything else they hold) and launches. A plan's descriptors are its own: one call at a time.


def _launch_pointed(launch: Launch, descs: tuple, tensors: tuple, *rest: torch.Tensor) -> None:
    """launch(*descs, *rest) with descs, each describing the tensor in its place (the same shape, strides and
    alignment as the one it was made for), then released: a plan outlives its call, and must not keep the call's
    tensors alive."""
    for desc, t in zip(descs, tensors):
        if desc is not None:
            desc.base = t
    launch(*descs, *rest)
    _released(descs)


def _released(descs: tuple) -> tuple:
    for desc in descs:
        if desc is not None:
            desc.base = None
    return descs


class ForwardPlan:
    """forward() of one input signature, resolved: `plan(q, k, v, bounds) -> (o, lse)`, bounds the call's document
    bounds where the signature has documents (as triton/host.py's); with them, the order of the work items too."""

    __slots__ = ("launch", "descs", "lse_shape", "order")

    def __init__(self, launch: Launch, descs: tuple, lse_shape: tuple[int, ...], order: Optional[ItemOrder]):
        self.launch, self.descs, self.lse_shape, self.order = launch, _released(descs), lse_shape, order

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
        o = empty_like(q)
        lse = empty(self.lse_shape, torch.float32, q.device)
        starts, ends = bounds or (lse, lse)  # unread without documents
        order = lse if self.order is None else self.order(starts, ends)
        _launch_pointed(self.launch, self.descs, (q, k, v, o), lse, starts, ends, order)
        return o, lse


class BackwardPlan:
    """The delta pre-pass and backward() of one input signature, resolved: `plan(q, k, v, o, lse, do, bounds)`,
    bounds as in ForwardPlan; accumulator_shape: the fused backward's dQ accumulator's (backward()), None when the
    plan runs the two kernels; share_shape: that of the query heads' shares of dK and dV its dK/dV programs write
    (the function share_shape), None when they write dK and dV."""

    __slots__ = ("delta", "dkdv", "dkdv_descs", "dq", "dq_descs", "delta_shape", "accumulator_shape", "share_shape")

    def __init__(self, delta: Launch, resolved: tuple, delta_shape: tuple[int, ...],
                 accumulator_shape: Optional[tuple[int, ...]] = None,
                 share_shape: Optional[tuple[int, ...]] = None):
        self.delta, self.delta_shape, self.accumulator_shape = delta, delta_shape, accumulator_shape
        self.dkdv, dkdv_descs, self.dq, dq_descs = resolved
        self.dkdv_descs, self.dq_descs, self.share_shape = _released(dkdv_descs), _released(dq_descs), share_shape

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 do: torch.Tensor, bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        delta = empty(self.delta_shape, torch.float32, q.device)
        bounds = bounds or (lse, lse)
        shares = empty_shares(self.share_shape, q)
        dkdv_out = shares or (dk, dv)
        if self.accumulator_shape is not None:
            acc = empty(self.accumulator_shape, torch.float32, q.device)
            self.delta(o, do, delta, acc)  # which zeroes acc
            _launch_pointed(self.dkdv, self.dkdv_descs, (q, k, v, do, *dkdv_out, lse, delta, acc), *bounds)
            self.dq(acc, dq)
        else:
            self.delta(o, do, delta, delta)
            _side_by_side(q.device.index or 0,
                          lambda: _launch_pointed(self.dkdv, self.dkdv_descs, (q, k, v, do, *dkdv_out, lse, delta),
                                                  *bounds),
                          lambda: _launch_pointed(self.dq, self.dq_descs, (q, k, v, do, dq), lse, delta, *bounds))
        if shares is not None:
            sum_shares(shares, as_bhsd(dk), as_bhsd(dv))
        return dq, dk, dv


def planned_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window: Optional[int] = None,
                    bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[ForwardPlan]]:
    """(o, lse) of inputs (shaped as the registry takes them, or (batch, heads, seq, d)) that forward_problem
    accepted, and the plan that repeats the call for inputs of the same signature (None for more than 4 dims).
    bounds: the documents' (ForwardPlan)."""
    o, lse, launch, descs, item_order = _forward_call(q, k, v, causal, scale, Masks(window, *(bounds or ())))
    return o, lse, ForwardPlan(launch, descs, tuple(lse.shape), item_order) if plannable(q, k, v) else None


def planned_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                     do: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
                     bounds: Optional[tuple] = None, fused: bool = False) -> tuple:
    """(dq, dk, dv, plan) of inputs that backward_problem accepted, as planned_forward; lse contiguous, as the
    forwards make it; fused: run the fused backward."""
    masks = Masks(window, *(bounds or ()))
    dq, dk, dv, delta, delta_launch, resolved = _backward_call(q, k, v, o, lse, do, causal, scale, masks, fused)
    usable = plannable(q, k, v, o, do) and lse.is_contiguous()
    if not usable:
        return dq, dk, dv, None
    q4 = as_bhsd(q)
    shape = accumulator_shape(q4) if fused else None
    return dq, dk, dv, BackwardPlan(delta_launch, resolved, tuple(delta.shape), shape,
                                    share_shape(q4, as_bhsd(k), fused))


@functools.cache
def _side_stream(device_index: int) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
    """The second stream of _side_by_side and its two events, made once and recorded again on each call: creating
    them per call, as Stream.wait_stream does, costs host time on every backward (docs/flash.md). One backward at a
    time uses them: autograd runs a device's backward on one thread."""
    return torch.cuda.Stream(device_index), torch.cuda.Event(), torch.cuda.Event()


def _backward_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, query_rows: int,
                     key_rows: int):
    """Descriptors of q, k, v, dO (q and dO in blocks of query_rows, k and v of key_rows) and their view indices."""
    return zip(*(_descriptor(t, rows) for t, rows in ((q, query_rows), (k, key_rows), (v, key_rows), (do, query_rows))))


def backward_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
                  t: HopperTiles, masks: Masks = NO_MASKS,
                  dq_acc: Optional[torch.Tensor] = None) -> tuple[Launch, tuple]:
    """The dK/dV kernel of `backward`: t.block_m key rows per consumer, query tiles of t.block_n streamed; a program
    per (batch, key/value head) and key rows, over the query tiles of its group's heads. With dq_acc
    (accumulator_shape(q), zeroed) it adds dQ there too (the fused backward); the last descriptor returned is then the
    accumulator's, else None stands in its place.

    dk and dv are like k and v, or with GQA shares of them (share_shape): a program per (batch, query head)
    then writes its head's share, and the caller sums them (sum_shares)."""
    import triton

    from attention.flash.hopper.kernels import attn_bwd_dkdv_hopper

    b, h, n, d = q.shape
    kv = k.shape[1]
    shares = dk.shape[1] != kv
    if shares and (tuple(dk.shape) != tuple(q.shape) or not dk.is_contiguous()):
        raise ValueError("shares of dK and dV must be contiguous and shaped like q")
    _check_tiles(n, t)
    descs, indices = _backward_inputs(q, k, v, do, t.block_n, t.block_m)
    starts, ends, window = masks.arguments(lse)
    outputs = ((_descriptor(dk, t.block_m)[0], _descriptor(dv, t.block_m)[0]) if shares else
               (_output_descriptor(dk, indices[1], t.block_m), _output_descriptor(dv, indices[2], t.block_m)))
    descs = (*descs, *outputs, _row_stats_descriptor(lse, t.block_n), _row_stats_descriptor(delta, t.block_n),
             None if dq_acc is None else _accumulator_descriptor(dq_acc, fused_dq_cols(d, t.consumers), t.block_n))
    grid = (triton.cdiv(n, t.rows), b * (h if shares else kv))
    args = (*descs, starts, ends, *(x for index in indices for x in index), h, n, window, scale * math.log2(math.e),
            scale)
    meta = dict(_meta(t, causal, 1 if shares else h // kv, **masks.constexprs()), FUSED=False, DS_LAYOUT=None,
                DQ_REGS=0, SHARED_KV=h // kv if shares else 1)
    if dq_acc is not None:
        meta.update(fused_meta(t, d, q.dtype))
    return _launch_of(attn_bwd_dkdv_hopper, attn_bwd_dkdv_hopper[grid](*args, **meta), grid, args, 11, meta), descs


def share_shape(q: torch.Tensor, k: torch.Tensor, fused: bool) -> Optional[tuple[int, ...]]:
    """Where the backward (fused or not) of (batch, heads, seq, d) q and k runs a dK/dV program per query head
    (inputs.query_head_programs): the shape of each query head's share of dK and of dV, q's; else None."""
    return tuple(q.shape) if query_head_programs(q.shape[1], k.shape[1], q.shape[2], fused) else None


def empty_shares(shape: Optional[tuple[int, ...]], q: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Empty shares of dK and dV of a share_shape (in q's dtype, on its device), or None for None."""
    return None if shape is None else (empty(shape, q.dtype, q.device), empty(shape, q.dtype, q.device))


def sum_shares(shares: tuple[torch.Tensor, torch.Tensor], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dk and dv ((batch, kv heads, seq, d) views) = the sums of the query heads' shares over each group, in fp32."""
    for share, out in zip(shares, (dk, dv)):
        b, kv, n, d = out.shape
        torch.sum(share.view(b, kv, share.shape[1] // kv, n, d), dim=2, out=out)


def accumulator_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """The fused backward's fp32 accumulator of dQ for (batch, heads, seq, d) q: (batch * heads, seq, d)."""
    b, h, n, d = q.shape
    return b * h, n, d


def _accumulator_descriptor(acc: torch.Tensor, cols: int, block_n: int):
    """A TMA descriptor of the accumulator acc (accumulator_shape) as (batch * heads * seq, d) rows, in blocks of
    (block_n, cols): cols of d in one dQ tile (fused_dq_cols)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bh, n, d = acc.shape
    return TensorDescriptor.from_tensor(acc.view(bh * n, d), [block_n, cols], accumulator_layout(block_n, cols))


@functools.cache
def accumulator_layout(block_n: int, cols: int):
    """The shared layout of a (block_n, cols) fp32 dQ tile on its way to the accumulator."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([block_n, cols], gl.float32)


def backward_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, dq: torch.Tensor, causal: bool, scale: float, t: HopperTiles,
                masks: Masks = NO_MASKS) -> tuple[Launch, tuple]:
    """The dQ kernel of `backward`: t.block_m query rows per consumer, key tiles of t.block_n streamed."""
    import triton

    from attention.flash.hopper.kernels import attn_bwd_dq_hopper

    b, h, n, d = q.shape
    _check_tiles(n, t)
    descs, indices = _backward_inputs(q, k, v, do, t.block_m, t.block_n)
    starts, ends, window = masks.arguments(lse)
    descs = (*descs, _output_descriptor(dq, indices[0], t.block_m))
    grid = (triton.cdiv(n, t.rows), b * h)
    args = (*descs, lse, delta, starts, ends, *(x for index in indices for x in index), h, n, window,
            scale * math.log2(math.e), scale)
    meta = _meta(t, causal, h // k.shape[1], **masks.constexprs())
    return _launch_of(attn_bwd_dq_hopper, attn_bwd_dq_hopper[grid](*args, **meta), grid, args, 9, meta), descs
