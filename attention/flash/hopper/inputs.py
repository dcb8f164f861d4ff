"""Which inputs flash's Hopper kernels take, and why not: forward_problem and backward_problem, which
attention.flash.dispatch asks. Every other input keeps the Triton kernels."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from attention.flash.common import sm_count
from attention.flash.hopper.tiles import backward_tiles_for

HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
CAPABILITY = (9, 0)  # sm_90: wgmma, TMA and warp specialisation as these kernels use them
SEQ_MULTIPLE = 128  # whole query and key tiles: a tile past the end would read the next head's rows
MAX_PROGRAM_ROWS = 65535  # batch * heads goes on CUDA grid axis 1
# Scores are batch * heads * n^2, halved when causal. Below these, by pass and head dim, eager calls keep the Triton
# kernels: their host time per call is the shorter, and it decides (docs/flash.md, Host time of short sequences).
MIN_SCORES = {"forward": {64: 2**28, 128: 2**26}, "backward": {64: 2**27, 128: 2**26}}
# Launches replayed from a CUDA graph (attention.graph_replay, or a capture in progress) cost no host time, so the GPU
# time alone decides: the Hopper backward wins at any size, the forward from these scores (docs/flash.md, CUDA graphs).
REPLAYED_MIN_SCORES = {"forward": {64: 2**27, 128: 0}, "backward": {64: 0, 128: 0}}


def min_scores_at_every_head_dim(forward: int, backward: int) -> dict[str, dict[int, int]]:
    """A MIN_SCORES table with one bound per pass at every head dim: for measurements and tests that set where eager
    calls take the Hopper kernels."""
    return {"forward": dict.fromkeys(HEAD_DIMS, forward), "backward": dict.fromkeys(HEAD_DIMS, backward)}


@functools.cache
def gluon_problem() -> Optional[str]:
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



def min_scores(d: int, pass_name: str, replayed: bool) -> int:
    """The fewest scores for which the Hopper kernels of `pass_name` ("forward" or "backward") run at head dim d (one of
    HEAD_DIMS; see MIN_SCORES)."""
    return (REPLAYED_MIN_SCORES if replayed else MIN_SCORES)[pass_name][d]


def scores(batch_heads: int, n: int, causal: bool, window: Optional[int] = None) -> int:
    """The attention scores a problem computes: batch * heads * n^2, halved when causal. With a window, those of the
    key tiles it visits: each row's band widened by a tile (SEQ_MULTIPLE keys), as the masked tiles at its edges cost
    about as much as whole ones. Documents, unknown on the host, count as whole."""
    whole = batch_heads * n * n // (2 if causal else 1)
    if window is None:
        return whole
    band = window + SEQ_MULTIPLE if causal else 2 * window + SEQ_MULTIPLE
    return min(whole, batch_heads * n * band)


# The two backward kernels side by side run dQ's programs beside dK/dV's, so they take less GPU time than the fused
# backward where its dK/dV programs (fused_dkdv_programs) fill fewer waves of the GPU's SMs than "waves" says, by the
# sequence length each bound holds from (from 16384 keys the programs' streams are long: 512 of them on 132 SMs ran
# faster fused), and at d 128 below "seq" keys (replayed from CUDA graphs, H200; docs/flash.md, Backward modes).
FUSED_MIN = {"waves": {0: 4, 16384: 3}, "seq": {64: 0, 128: 2048}}
FUSED_AT_EVERY_SIZE = {"waves": {0: 0}, "seq": dict.fromkeys(HEAD_DIMS, 0)}  # for measurements and tests
OFF_GPU_SMS = 132  # an H100 SXM's or an H200's: what a decision for a capability, not a device, assumes


def fused_backward_problem(batch: int, heads: int, kv_heads: int, n: int, d: int, sms: int,
                           window: Optional[int] = None, docs: bool = False) -> Optional[str]:
    """Why the Hopper backward runs its dK/dV and dQ kernels side by side rather than fused (dQ added with TMA
    reductions by the dK/dV kernel), where determinism is not asked for; None when it runs fused. n: the sequence;
    sms: the GPU's SMs."""
    if window is not None or docs:
        return "the fused backward takes no window or documents"
    if n < FUSED_MIN["seq"][d]:
        return f"faster than the fused backward below {FUSED_MIN['seq'][d]} keys at d {d}"
    programs = fused_dkdv_programs(batch, heads, kv_heads, n, d, sms)
    waves = FUSED_MIN["waves"][max(seq for seq in FUSED_MIN["waves"] if seq <= n)]
    if programs < waves * sms:
        return (f"faster than the fused backward's {programs} dK/dV program{'s' * (programs != 1)}, under "
                f"{waves} waves of {sms} SMs")
    return None


def fused_dkdv_programs(batch: int, heads: int, kv_heads: int, n: int, d: int, sms: int) -> int:
    """The fused backward's dK/dV programs: one per (batch, key/value head) and tile of key rows, or per query head
    (query_head_programs)."""
    rows = backward_tiles_for(d, n, batch * kv_heads, sms, fused=True)["dkdv"].rows
    return batch * (heads if query_head_programs(heads, kv_heads, n, fused=True) else kv_heads) * -(-n // rows)


# With GQA a dK/dV program of the Hopper backward streams its group's query heads one after another (reading their Q
# and dO, and fused, adding to their dQ). By backward mode, for groups of at least "group" query heads and sequences
# of at least "seq" keys it runs a program per query head instead, which streams that head alone; the heads' shares
# of dK and dV are summed after, in an order that does not vary. Measured faster there; level or slower for groups of
# 4, and for groups of 8 deterministic (beside the dQ kernel) or fused at 2048 keys (H200; docs/flash.md, Backward
# modes).
MODES = ("fused", "deterministic")  # the Hopper backward's two modes
QUERY_HEAD_PROGRAMS_MIN = {"fused": {"group": 8, "seq": 4096}, "deterministic": {"group": 16, "seq": 2048}}
QUERY_HEAD_PROGRAMS_AT_EVERY_SIZE = dict.fromkeys(MODES, {"group": 2, "seq": 0})
QUERY_HEAD_PROGRAMS_NEVER = dict.fromkeys(MODES, {"group": 2, "seq": 2**31})  # these two for measurements and tests


def query_head_programs(heads: int, kv_heads: int, n: int, fused: bool) -> bool:
    """Whether the Hopper backward, fused or deterministic, runs a dK/dV program per query head, each writing its
    head's share of dK and dV for the host to sum over the group, rather than one per key/value head."""
    least = QUERY_HEAD_PROGRAMS_MIN["fused" if fused else "deterministic"]
    return heads >= least["group"] * kv_heads and n >= least["seq"]


def sm_count_of(t: torch.Tensor) -> int:
    """The SMs of t's GPU; OFF_GPU_SMS for a tensor that is not on one."""
    return sm_count(t.device.index or 0) if t.is_cuda else OFF_GPU_SMS


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
            or _layout_problem(q=q, k=k, v=v) or gluon_problem())


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
            or _layout_problem(q=q, k=k, v=v, dO=do) or gluon_problem())
