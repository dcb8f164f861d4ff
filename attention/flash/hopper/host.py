"""Host side of flash's Hopper kernels (hopper_kernels.py): which inputs they take, their tiles, the launches.

attention.flash.choose_kernels asks `forward_problem` and `backward_problem` and runs these kernels when the answer
is None. Every other input keeps the Triton kernels: other GPUs, fp32, other head dims, sequences that are not whole
tiles, problems small enough to be bound by host time (unless the launches are replayed from a CUDA graph), the CPU
interpreter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from attention.flash.common import as_bhsd, bounds_of, empty, empty_like, on_device_of
from attention.flash.triton.host import Launch, delta_and_launch, plannable, work_order

HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
CAPABILITY = (9, 0)  # sm_90: wgmma, TMA and warp specialisation as these kernels use them
SEQ_MULTIPLE = 128  # whole query and key tiles: a tile past the end would read the next head's rows
MAX_PROGRAM_ROWS = 65535  # batch * heads goes on CUDA grid axis 1
# Scores are batch * heads * n^2, halved when causal. Below this, eager calls keep the Triton kernels: their host time
# per call is the shorter, and it decides. Eager calls run planned launches (docs/flash.md); with the Hopper backward
# forced, a forward+backward took 0.43-0.75 ms at B16 H12 N1024 and B1 H16 N4096 on the H100, against 0.47-0.60 ms
# with the Triton one (results/h100/2026-11-26-flash-host-time-hopper.txt).
MIN_SCORES = 2**28
# Launches replayed from a CUDA graph (attention.graph_replay, or a capture in progress) cost no host time per call,
# so the GPU time alone decides. Graphed on the H100, the Hopper backward took 11-23% less time than the Triton one
# at every size tried (B4 H20 N1024 up to B1 H16 N4096); the Hopper forward was faster from 2^27 scores at d 64
# (B1 H16 N4096: 0.117 against 0.123 ms; at B2 H16 N2048, 2^26, 0.072 against 0.070) and at every size tried at
# d 128.
REPLAYED_FORWARD_MIN_SCORES = {64: 2**27, 128: 0}
# A Hopper program holds an SM alone and pays its start and end (Q's load, the pipeline's fill, O's store) once. With
# few key tiles per row (documents, windows under this many keys) the forward runs persistent: a program per SM takes
# work items one after another, the next one's loads overlapping the last one's end. Kernel times (CUDA-graph replay)
# on the H100 at B1 H16 N16384 causal, persistent (64-key tiles) against a program per item and against the Triton
# forward: documents of mean length 1024 0.214 against 0.451 and 0.241 ms (0.205 with its items taken longest first,
# hopper_kernels._work_item). Windows, d 64, two / three consumers against a program per item: 256 keys 0.095 / 0.109
# against 0.201; 512 0.140 / 0.135 against 0.213; 1024 0.230 / 0.210 against 0.273; 2048 0.408 / 0.368 against 0.381;
# 3072 0.586 / 0.517 against 0.491 (longer rows hide a program's start). d 128: 256 keys 0.128 / 0.151; 1024 0.307 /
# 0.290 against 0.306. Documents, their items taken longest first, run three consumers: kernel alone, two / three, d 64
# mean length 1024 0.190 / 0.179 and 0.212 / 0.194 (two draws), 256 0.124 / 0.121, 4096 0.534 / 0.493, with GQA KV4
# 0.187 / 0.173; d 128 0.313 / 0.283. With a window as well they keep two: 1024 keys 0.181 / 0.205, 256 0.121 / 0.145,
# with GQA KV4 0.178 / 0.192 (results/h100/2026-11-28-flash-hopper-persistent-consumers.txt).
PERSISTENT_MAX_WINDOW = 3072
THREE_CONSUMERS_MIN_WINDOW = 512
# At d 128 two consumers streaming 128-key tiles in three slots (224 of an SM's 227 KB) ran faster than three consumers
# on 64-key tiles without a mask at every length tried, and with a causal mask from this length on faster or level
# (slower below it). Medians of 2-3 rounds taking turns, bf16, ms: not causal, B8 H16 N2048 0.473 against 0.504 (H200),
# B4 H16 N4096 0.904 against 0.960 (H200), B2 H16 N8192 1.701 against 1.830-1.983 (H100); causal, B4 H16 N4096 0.531
# against 0.546 (H200), B2 H16 N8192 0.942-0.950 against 0.955-1.000 (H100), GQA B4 H32 KV8 N8192 3.567-3.586 against
# 3.779-4.471 (H100), B1 H32 N32768 13.58-14.28 against 13.80 (H100), B1 H16 N16384 1.946 against 1.920 (H200, rounds
# 1.818-1.955); shorter causal rows took longer, B8 H16 N2048 0.305 against 0.299 (H200).
# results/h{100,200}/2026-11-28-flash-hopper-d128-*tiles.txt
WIDE_KEY_TILES_MIN_CAUSAL_SEQ = 4096


@dataclass(frozen=True)
class HopperTiles:
    """One program: `consumers` warpgroups of `block_m` resident rows; streamed tiles of `block_n` rows in `stages`
    slots. The forward and dQ keep query rows and stream keys; dK/dV keeps key rows and streams queries."""

    consumers: int
    block_n: int
    stages: int
    block_m: int = 64  # one warpgroup's wgmma rows
    persistent: bool = False  # the forward only: a program per SM runs work items one after another

    @property
    def rows(self) -> int:
        return self.block_m * self.consumers

    @property
    def consumer_regs(self) -> int:
        # 65536 registers per SM shared by the consumer warpgroups and the producer's (24 per thread).
        return {2: 240, 3: 160}[self.consumers]


def tiles_for(d: int, n: int, batch_heads: int, sm_count: int, window: Optional[int] = None,
              docs: bool = False, causal: bool = True) -> HopperTiles:
    """The forward's tiles: persistent for short key ranges (documents, windows under PERSISTENT_MAX_WINDOW), with
    three consumers for documents alone and for windows from THREE_CONSUMERS_MIN_WINDOW keys without documents, two
    for documents with a window and for shorter windows; at d 128 without a window, when not causal or from
    WIDE_KEY_TILES_MIN_CAUSAL_SEQ causal rows, two consumers on 128-key tiles; otherwise three consumers (192 rows a
    program) when that still gives every SM four programs, else two.

    Measured on the H100: three consumers ran the B1 H16 N16384 d 64 causal forward 8% faster than two, d 128
    causal 9% (both on 64-key tiles), d 64 not causal 12%. At B1 H16 N4096 (352 programs of 192 rows on 132 SMs) two
    were 16% faster in one run and 4% slower in the next, where host time bounds both; that size now stays below
    MIN_SCORES.
    """
    if docs or (window is not None and window < PERSISTENT_MAX_WINDOW):
        if window is not None and (docs or window < THREE_CONSUMERS_MIN_WINDOW):
            return HopperTiles(consumers=2, block_n=64, stages=4, persistent=True)
        # d 128: three slots, as the plain three-consumer forward there (four would take 224 of an SM's 227 KB).
        return HopperTiles(consumers=3, block_n=64, stages=4 if d == 64 else 3, persistent=True)
    if d == 128 and window is None and (not causal or n >= WIDE_KEY_TILES_MIN_CAUSAL_SEQ):
        return HopperTiles(consumers=2, block_n=128, stages=3)
    block_n = 128 if d == 64 else 64
    three = HopperTiles(consumers=3, block_n=block_n, stages=3)
    if batch_heads * math.ceil(n / three.rows) >= 4 * sm_count:
        return three
    return HopperTiles(consumers=2, block_n=block_n, stages=3 if d == 64 else 4)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _gluon_problem() -> Optional[str]:
    try:
        from attention.flash.hopper import kernels  # noqa: F401
    except Exception as e:  # an older triton has no Gluon, or a Gluon API these kernels were not written for
        return f"triton's Gluon Hopper API is unavailable ({type(e).__name__}: {e})"
    return None


def rows_index(t: torch.Tensor) -> Optional[tuple[int, int, int, tuple[int, int]]]:
    """(rows per batch, rows per head, columns per head, 2-D shape) of a (batch, heads, seq, d) tensor, or None.

    Row b * rows_b + h * rows_h + position of the 2-D view, from column h * cols_h, holds t[b, h, position]. That
    covers (batch, heads, seq, d) storage (one row per position of each head) and (batch, seq, heads, d) storage
    (one row per position, the heads side by side), which is what the model hands over.
    """
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    if sd != 1:
        return None

    def stride_is(size: int, stride: int, want: int) -> bool:
        return size == 1 or stride == want  # a size-1 dim's stride is arbitrary

    if stride_is(h, sh, n * d) and stride_is(n, sn, d) and stride_is(b, sb, h * n * d):  # (batch, heads, seq, d)
        return h * n, n, 0, (b * h * n, d)
    if stride_is(h, sh, d) and stride_is(n, sn, h * d) and stride_is(b, sb, n * h * d):  # (batch, seq, heads, d)
        return n, 0, d, (b * n, h * d)
    return None


def rows_view(t: torch.Tensor) -> Optional[tuple[torch.Tensor, int, int, int]]:
    """(2-D view, rows per batch, rows per head, columns per head) of t, as rows_index describes it, or None."""
    index = rows_index(t)
    if index is None:
        return None
    rows_b, rows_h, cols_h, (rows, cols) = index
    return torch.as_strided(t, (rows, cols), (cols, 1)), rows_b, rows_h, cols_h


def min_scores(d: int, pass_name: str, replayed: bool) -> int:
    """The fewest scores for which the Hopper kernels of `pass_name` ("forward" or "backward") run (see MIN_SCORES)."""
    if not replayed:
        return MIN_SCORES
    return REPLAYED_FORWARD_MIN_SCORES.get(d, 0) if pass_name == "forward" else 0


def scores(batch_heads: int, n: int, causal: bool, window: Optional[int] = None) -> int:
    """The attention scores a problem computes: batch * heads * n^2, halved when causal. With a window, those of the
    key tiles it visits: each row's band widened by a tile (SEQ_MULTIPLE keys), as the masked tiles at its edges cost
    about as much as whole ones. Documents, unknown on the host, count as whole."""
    whole = batch_heads * n * n // (2 if causal else 1)
    if window is None:
        return whole
    band = window + SEQ_MULTIPLE if causal else 2 * window + SEQ_MULTIPLE
    return min(whole, batch_heads * n * band)


def device_capability(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(major, minor) of t's GPU, or None for a tensor that is not on one."""
    return _capability(t.device.index) if t.is_cuda else None


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:  # asked once: 3 us a call, twice per attention call
    return tuple(torch.cuda.get_device_capability(device_index))


def problem(pass_name: str, capability: Optional[tuple[int, int]], dtype: torch.dtype, batch_heads: int, n_q: int,
            n_k: int, d: int, causal: bool, replayed: bool, window: Optional[int] = None,
            docs: bool = False) -> Optional[str]:
    """Why the Hopper kernels of `pass_name` cannot take a problem of this size and dtype on a GPU of `capability`
    (None: the tensors are not on a GPU), or None when they can; memory layouts and Triton's Gluon aside.

    replayed: the launches will be replayed from a CUDA graph, so host time does not count. window: the call's
    window. docs: whether it packs documents; their extent is unknown on the host, so the scores are counted as
    without them.
    """
    if capability is None:
        return "the Hopper kernels need CUDA tensors"
    if tuple(capability) != CAPABILITY:
        return f"the Hopper kernels need an sm_90 (Hopper) GPU, this is sm_{capability[0]}{capability[1]}"
    if dtype not in DTYPES:
        return f"the Hopper kernels take float16 and bfloat16, not {dtype}"
    if d not in HEAD_DIMS:
        return f"the Hopper kernels take head dims {HEAD_DIMS}, not {d}"
    if n_k != n_q:
        return f"the Hopper kernels need as many keys as queries, got {n_k} and {n_q}"
    if n_q % SEQ_MULTIPLE:
        return f"the Hopper kernels need a sequence that is a multiple of {SEQ_MULTIPLE}, got {n_q}"
    if batch_heads > MAX_PROGRAM_ROWS:
        return f"the Hopper kernels run at most {MAX_PROGRAM_ROWS} (batch, head) pairs, got {batch_heads}"
    if batch_heads * n_q >= 2**31:
        return "the Hopper kernels' TMA coordinates are 32-bit: batch * heads * seq must be below 2^31"
    count, fewest = scores(batch_heads, n_q, causal, window), min_scores(d, pass_name, replayed)
    if count < fewest:
        why = "the Triton forward takes less GPU time" if replayed else "host time outweighs the faster kernels"
        return f"{power_of_two(count)} scores are too few for the Hopper kernels: below {power_of_two(fewest)} {why}"
    return None


def power_of_two(n: int) -> str:
    """n as 2^k when it is one, else as a plain number."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def _layout_problem(**tensors: torch.Tensor) -> Optional[str]:
    for name, t in tensors.items():
        if rows_index(t) is None:  # the index alone: the launch builds the views, once
            return f"the Hopper kernels need {name} in (batch, heads, seq, d) or (batch, seq, heads, d) memory"
    return None


def forward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, replayed: bool = False,
                    capability: Optional[tuple[int, int]] = None, window: Optional[int] = None,
                    docs: bool = False) -> Optional[str]:
    """Why the Hopper forward cannot run these (batch, heads, seq, d) inputs, or None when it can.

    replayed: the launch will be replayed from a CUDA graph (attention.registry.launches_replayed), so host time
    does not count. capability: decide for a GPU of this (major, minor) instead of q's device. window, docs: the
    call's window, and whether it packs documents (see `problem`).
    """
    b, h, n, d = q.shape
    capability = capability or device_capability(q)
    return (problem("forward", capability, q.dtype, b * h, n, k.shape[-2], d, causal, replayed, window, docs)
            or _layout_problem(q=q, k=k, v=v) or _gluon_problem())


def backward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
                     replayed: bool = False, capability: Optional[tuple[int, int]] = None,
                     window: Optional[int] = None, docs: bool = False) -> Optional[str]:
    """Why the Hopper dK/dV and dQ kernels cannot run these (batch, heads, seq, d) inputs, or None when they can.
    window, docs: as forward_problem."""
    b, h, n, d = q.shape
    capability = capability or device_capability(q)
    if do.dtype != q.dtype:
        return f"the Hopper kernels need dO in q's dtype, got dO {do.dtype} and q {q.dtype}"
    return (problem("backward", capability, q.dtype, b * h, n, k.shape[-2], d, causal, replayed, window, docs)
            or _layout_problem(q=q, k=k, v=v, dO=do) or _gluon_problem())


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
    """The order in which the persistent forward takes its work items with documents (triton.work_order), resolved:
    `order(starts, ends)` ranks them for a call's document bounds."""

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
    t = tiles or tiles_for(d, n, b * h, _sm_count(q.device.index or 0), masks.window, masks.starts is not None,
                           causal)
    _check_tiles(n, t)
    q_desc, q_index = _descriptor(q, t.block_m)
    k_desc, k_index = _descriptor(k, t.block_n)
    v_desc, v_index = _descriptor(v, t.block_n)
    starts, ends, window = masks.arguments(lse)
    order, item_order = lse, None  # read by persistent programs with documents only (hopper_kernels._work_item)
    if t.persistent and masks.starts is not None:
        order, launch = work_order(starts, ends, n, t.rows, t.block_n, causal, masks.window)
        item_order = ItemOrder(launch, tuple(order.shape))
    descs = (q_desc, k_desc, v_desc, _output_descriptor(o, q_index, t.block_m))
    items = (triton.cdiv(n, t.rows), b * h)
    grid = (min(items[0] * items[1], _sm_count(q.device.index or 0)), 1) if t.persistent else items
    args = (*descs, lse, starts, ends, order, *q_index, *k_index, *v_index, h, n, b * h, window,
            scale * math.log2(math.e))
    meta = dict(_meta(t, causal, h // k.shape[1], **masks.constexprs()), PERSISTENT=t.persistent)
    launch = _launch_of(attn_fwd_hopper, attn_fwd_hopper[grid](*args, **meta), grid, args, 8, meta)
    return launch, descs, item_order


def backward_tiles_for(d: int, n: int, batch_heads: int, sm_count: int) -> dict[str, HopperTiles]:
    """dK/dV and dQ tiles: 64 resident rows per consumer; 64-row streamed tiles (32 for dK/dV at d 128).

    Measured on the H100, each against the other configs in the same run:
    - dK/dV keeps two consumers. Three get 160 registers each, too few for its two accumulators and two score tiles
      (they spill), except with 32-row query tiles, which ran 8-13% slower than two consumers' best. Four slots:
      it issues the next tile's S^T before it releases the tile before, and with three slots that waits on the
      load (9-13% slower without a mask than four slots).
    - dQ at d 64 takes three consumers, as the forward does, when that still gives every SM four programs: 5-9%
      faster than two at N16384. At d 128 three consumers ran 44% slower than two.
    - dK/dV at d 128 keeps 32-row query tiles. Since L and delta moved to shared memory, 64-row tiles no longer
      spill inside the loop (`python -m attention.flash.hopper.resources dkdv,128,2,64,4`), but they ran 2% slower
      (causal) and 1% slower (not causal) at B2 H16 N8192. dQ with two key tiles of 128 rows at d 64 ran 18-27%
      slower than three consumers.
    """
    if d == 128:
        return {"dkdv": HopperTiles(2, 32, 4), "dq": HopperTiles(2, 64, 4)}
    dq = HopperTiles(3, 64, 4)
    if batch_heads * math.ceil(n / dq.rows) < 4 * sm_count:
        dq = HopperTiles(2, 64, 4)
    return {"dkdv": HopperTiles(2, 64, 4), "dq": dq}


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
             tiles: Optional[dict[str, HopperTiles]] = None, masks: Masks = NO_MASKS) -> tuple:
    """Write dq, dk, dv (each in its input's memory order) for inputs backward_problem accepted; k and v may have
    fewer heads than q (GQA). Returns the launches resolved with their descriptors: (dK/dV launch, its descriptors
    of q, k, v, dO, dK, dV, L, delta; dQ launch, its descriptors of q, k, v, dO, dQ) (see BackwardPlan).

    lse and delta are (batch * heads, seq) fp32: the forward's natural-log logsumexp and rowsum(dO * O).
    """
    b, h, n, d = q.shape
    tiles = {**backward_tiles_for(d, n, b * h, _sm_count(q.device.index or 0)), **(tiles or {})}
    dkdv, dq_pass = _side_by_side(
        q.device.index or 0,
        lambda: backward_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, tiles["dkdv"], masks),
        lambda: backward_dq(q, k, v, do, lse, delta, dq, causal, scale, tiles["dq"], masks))
    return (*dkdv, *dq_pass)


def _side_by_side(device_index: int, dkdv: Callable[[], Any], dq: Callable[[], Any]) -> tuple[Any, Any]:
    """(dkdv(), dq()): the dK/dV launch on the current stream and the dQ launch on a second one beside it.

    The two kernels are independent: dQ's programs take the SMs that dK/dV's last wave leaves idle instead of waiting
    for the whole kernel to drain (6-12% faster than one after the other on the H100)."""
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
                 starts: Optional[torch.Tensor] = None,
                 ends: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of (batch, heads, seq, d) inputs that backward_problem accepted, after Triton's delta pre-pass."""
    return _backward_call(q4, k4, v4, o4, lse, do4, causal, scale, Masks(window, starts, ends))[:3]


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
                   do: torch.Tensor, causal: bool, scale: float, masks: Masks) -> tuple:
    """(dq, dk, dv, delta, delta launch, backward()'s launches and descriptors), as _forward_call."""
    q4, k4, v4, o4, do4 = (as_bhsd(t) for t in (q, k, v, o, do))
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    with on_device_of(q):
        delta, delta_launch = delta_and_launch(o4, do4)
        resolved = backward(q4, k4, v4, do4, lse, delta, as_bhsd(dq), as_bhsd(dk), as_bhsd(dv), causal, scale,
                            masks=masks)
    return dq, dk, dv, delta, delta_launch, resolved


# ----------------------------------------------------------------------------------------------------------
# Plans: a Hopper forward or backward resolved for one input signature (triton.py's plans say why)
# ----------------------------------------------------------------------------------------------------------
# Eager, a Hopper backward spent 0.67 ms of host time building 13 TMA descriptors and binding two launches through
# Triton's JIT (H100, B4 H20 N1024). A plan keeps the compiled kernels and the descriptors: each call points the
# descriptors at its tensors (the launch encodes a descriptor when it is made, so the objects can be reused; the
# signature fixes everything else they hold) and launches. A plan's descriptors are its own: one call at a time.


def _launch_pointed(launch: Launch, descs: tuple, tensors: tuple, *rest: torch.Tensor) -> None:
    """launch(*descs, *rest) with descs, each describing the tensor in its place (the same shape, strides and
    alignment as the one it was made for), then released: a plan outlives its call, and must not keep the call's
    tensors alive."""
    for desc, t in zip(descs, tensors):
        desc.base = t
    launch(*descs, *rest)
    _released(descs)


def _released(descs: tuple) -> tuple:
    for desc in descs:
        desc.base = None
    return descs


class ForwardPlan:
    """forward() of one input signature, resolved: `plan(q, k, v, bounds) -> (o, lse)`, bounds the call's document
    bounds where the signature has documents (triton.ForwardPlan); with them, the order of the work items too."""

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
    bounds as in ForwardPlan."""

    __slots__ = ("delta", "dkdv", "dkdv_descs", "dq", "dq_descs", "delta_shape")

    def __init__(self, delta: Launch, resolved: tuple, delta_shape: tuple[int, ...]):
        self.delta, self.delta_shape = delta, delta_shape
        self.dkdv, dkdv_descs, self.dq, dq_descs = resolved
        self.dkdv_descs, self.dq_descs = _released(dkdv_descs), _released(dq_descs)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 do: torch.Tensor, bounds: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        delta = empty(self.delta_shape, torch.float32, q.device)
        bounds = bounds or (lse, lse)
        self.delta(o, do, delta)
        _side_by_side(q.device.index or 0,
                      lambda: _launch_pointed(self.dkdv, self.dkdv_descs, (q, k, v, do, dk, dv, lse, delta), *bounds),
                      lambda: _launch_pointed(self.dq, self.dq_descs, (q, k, v, do, dq), lse, delta, *bounds))
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
                     bounds: Optional[tuple] = None) -> tuple:
    """(dq, dk, dv, plan) of inputs that backward_problem accepted, as planned_forward; lse contiguous, as the
    forwards make it."""
    masks = Masks(window, *(bounds or ()))
    dq, dk, dv, delta, delta_launch, resolved = _backward_call(q, k, v, o, lse, do, causal, scale, masks)
    usable = plannable(q, k, v, o, do) and lse.is_contiguous()
    return dq, dk, dv, BackwardPlan(delta_launch, resolved, tuple(delta.shape)) if usable else None


@functools.cache
def _side_stream(device_index: int) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
    """The second stream of _side_by_side and its two events, made once and recorded again on each call: creating
    them per call, as Stream.wait_stream does, cost about 20 us of host time per backward on the H100 machine. One
    backward at a time uses them: autograd runs a device's backward on one thread."""
    return torch.cuda.Stream(device_index), torch.cuda.Event(), torch.cuda.Event()


def _backward_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, query_rows: int,
                     key_rows: int):
    """Descriptors of q, k, v, dO (q and dO in blocks of query_rows, k and v of key_rows) and their view indices."""
    return zip(*(_descriptor(t, rows) for t, rows in ((q, query_rows), (k, key_rows), (v, key_rows), (do, query_rows))))


def backward_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                  delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
                  t: HopperTiles, masks: Masks = NO_MASKS) -> tuple[Launch, tuple]:
    """The dK/dV kernel of `backward`: t.block_m key rows per consumer, query tiles of t.block_n streamed; a program
    per (batch, key/value head) and key rows, over the query tiles of its group's heads."""
    import triton

    from attention.flash.hopper.kernels import attn_bwd_dkdv_hopper

    b, h, n, d = q.shape
    _check_tiles(n, t)
    descs, indices = _backward_inputs(q, k, v, do, t.block_n, t.block_m)
    starts, ends, window = masks.arguments(lse)
    descs = (*descs, _output_descriptor(dk, indices[1], t.block_m), _output_descriptor(dv, indices[2], t.block_m),
             _row_stats_descriptor(lse, t.block_n), _row_stats_descriptor(delta, t.block_n))
    grid = (triton.cdiv(n, t.rows), b * k.shape[1])
    args = (*descs, starts, ends, *(x for index in indices for x in index), h, n, window, scale * math.log2(math.e),
            scale)
    meta = _meta(t, causal, h // k.shape[1], **masks.constexprs())
    return _launch_of(attn_bwd_dkdv_hopper, attn_bwd_dkdv_hopper[grid](*args, **meta), grid, args, 10, meta), descs


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
