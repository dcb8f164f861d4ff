"""flash's decode attention: split-KV (flash-decoding), in PyTorch (the readable spec) and in Triton.

Decoding asks a few queries per sequence and head (q (..., heads, n_new, d_head)) to read a long key/value cache: the
work is reading the cache. Every cache head is read once for all the query rows that attend to it (the heads of its
GQA group times the n_new new tokens), and at small batch there are few such blocks of rows to spread over the GPU,
so the keys a block sees are split along their length into `num_splits` chunks. Each chunk computes every row's
partial softmax (its output already normalised, and the log-sum-exp of its scores), and the chunks are combined per
row:

    lse_c = log sum_{i in c} exp(s_i),   o_c = sum_{i in c} exp(s_i - lse_c) v_i
    o = sum_c exp(lse_c - lse) o_c,      lse = log sum_c exp(lse_c)

A block's keys run from the first any of its rows sees to the last; chunks are sized from that span (rounded up to
whole key tiles), so a short sequence in a batch of long ones does no wasted reads, and a chunk a row sees nothing
of weighs nothing for it. With a window the span covers only the rows' last `window` keys. The inputs, the meaning
of cache_len and the variants (GQA, window, softcap) are those of attention/decode.py.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from attention.decode import CacheLen, capped, lengths, repeat_kv, visible
from attention.flash.common import as_bhsd, empty, empty_like, on_device_of
from attention.flash.dispatch import _keep
from attention.flash.decode.tiles import MAX_SPLITS, DecodeTiles, default_num_splits, tiles_for
from attention.flash.triton.host import Launch, _block_d, _cdiv, _run, plannable
from attention.registry import register_decode

MAX_BLOCK_M = 64  # query rows per program; a larger group of rows is split into blocks that each read the cache

MIN_HEAD_DIM = 16  # the dots' smallest dimension
MAX_HEAD_DIM = 256  # a (BLOCK_N, d_head) tile of K and of V stays in registers
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def row_ranges(cache_len: CacheLen, q: torch.Tensor,
               window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, visible): each query row sees the keys [first, visible), both shaped (..., heads, n_new)."""
    n_new = q.shape[-2]
    visible = lengths(cache_len, q)[..., None] - n_new + 1 + torch.arange(n_new, device=q.device)
    first = (visible - window).clamp(min=0) if window is not None else torch.zeros_like(visible)
    return first, visible


def chunk_bounds(cache_len: CacheLen, q: torch.Tensor, kv_heads: int, num_splits: int, window: Optional[int] = None,
                 block_n: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the key range [lo, hi) of every (cache head, chunk), shaped (..., kv_heads, num_splits): the
    span of keys the rows of its group see, in chunks of whole tiles of block_n keys (default: the kernel's)."""
    block_n = block_n or _tiles(q).block_n
    first, visible = row_ranges(cache_len, q, window)
    by_group = first.shape[:-2] + (kv_heads, -1)  # (..., kv_heads, group * n_new)
    lo_all, hi_all = first.reshape(by_group).amin(-1), visible.reshape(by_group).amax(-1)
    chunk = (hi_all - lo_all + num_splits - 1) // num_splits
    chunk = (chunk + block_n - 1) // block_n * block_n
    lo = lo_all[..., None] + chunk[..., None] * torch.arange(num_splits, device=q.device)
    return lo, torch.minimum(lo + chunk[..., None], hi_all[..., None])


def decode_split_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                       scale: float, num_splits: int = 4, window: Optional[int] = None,
                       softcap: Optional[float] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Split-KV decode attention in plain PyTorch, chunk by chunk: what the Triton kernels compute with tiles of
    block_n keys (default: theirs for q; they further divide a group of more than MAX_BLOCK_M rows into blocks, each
    chunked alike)."""
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    max_len, group = k_cache.shape[-2], q.shape[-3] // k_cache.shape[-3]
    lo, hi = (t.repeat_interleave(group, dim=-2)[..., None, :]  # (..., heads, 1, num_splits)
              for t in chunk_bounds(cache_len, q, k_cache.shape[-3], num_splits, window, block_n))
    first, visible = row_ranges(cache_len, q, window)
    k_cache, v_cache = repeat_kv(k_cache, q), repeat_kv(v_cache, q)
    scores = torch.matmul(q.to(acc_dtype), k_cache.to(acc_dtype).transpose(-2, -1)) * scale  # (..., n_new, max_len)
    scores = capped(scores, softcap)
    pos = torch.arange(max_len, device=q.device)
    seen = (pos >= first[..., None]) & (pos < visible[..., None])  # (..., n_new, max_len)
    partial_o, partial_lse = [], []
    for c in range(num_splits):
        in_chunk = seen & (pos >= lo[..., c, None]) & (pos < hi[..., c, None])
        s = scores.masked_fill(~in_chunk, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees none of the chunk
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # 0 outside the chunk
        partial_o.append(torch.matmul(p, v_cache.to(acc_dtype)))
        partial_lse.append(lse)
    lse_c = torch.stack(partial_lse)  # (num_splits, ..., n_new)
    weights = torch.exp(lse_c - torch.logsumexp(lse_c, dim=0))
    return (weights[..., None] * torch.stack(partial_o)).sum(dim=0).to(q.dtype)


def decode_reference_f64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                         scale: float, window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Masked softmax in float64: the ground truth the tests hold both versions to."""
    k_cache, v_cache = repeat_kv(k_cache, q), repeat_kv(v_cache, q)
    scores = capped(torch.matmul(q.double(), k_cache.double().transpose(-2, -1)) * scale, softcap)
    scores = scores.masked_fill(~visible(cache_len, q, k_cache.shape[-2], window), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v_cache.double())


@functools.cache
def _kernels():
    from attention.flash.decode import kernels  # imports triton.language: only when a kernel runs

    return kernels


def _tiles(q: torch.Tensor) -> DecodeTiles:
    """The tiles the partial kernel streams for q's head dim and dtype (the caches'; the registry checks they match)."""
    return tiles_for(_block_d(q.shape[-1]), q.element_size(), _interpreting())


def _length_args(cache_len: CacheLen, q: torch.Tensor, q4: torch.Tensor) -> tuple:
    """The kernel's (LENS, stride_lb, stride_lh, fixed_len, LENS_TENSOR): a tensor of lengths read in place, in its
    own integer dtype, as (batch, heads) (broadcast strides; a copy only for leading dims that cannot merge), or an
    int passed as is (no host-to-device copy)."""
    if not isinstance(cache_len, torch.Tensor):
        return q4, 0, 0, int(cache_len), False
    if q.dim() > 4:
        lens = lengths(cache_len, q).reshape(q4.shape[:2])
        return lens, lens.stride(0), lens.stride(1), 0, True
    # cache_len's dims are the first of q.shape[:-2], which are the last q.dim() - 2 of (batch, heads).
    strides = (0, 0) + tuple(cache_len.stride()) + (0,) * (q.dim() - 2 - cache_len.dim())
    return cache_len, strides[-2], strides[-1], 0, True


class DecodePlan:
    """decode_triton() of one input signature, resolved: `plan(q, k_cache, v_cache, cache_len) -> o` allocates the
    output (and the partials) and launches the compiled kernels, nothing else. One split has no combine: the partial
    kernel writes the output."""

    __slots__ = ("partial", "combine", "part_numel")

    def __init__(self, partial: Launch, combine: Optional[Launch], part_numel: int):
        self.partial, self.combine, self.part_numel = partial, combine, part_numel

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_len: CacheLen) -> torch.Tensor:
        o = empty_like(q)
        lens = cache_len if isinstance(cache_len, torch.Tensor) else q  # an int is in the launch; q is never read
        if self.combine is None:
            self.partial(q, k_cache, v_cache, lens, o, o)
            return o
        part = empty((self.part_numel,), torch.float32, q.device)
        self.partial(q, k_cache, v_cache, lens, part, o)
        self.combine(part, o)
        return o


_plans: dict[tuple, DecodePlan] = {}  # decode signature -> plan (capped as dispatch's plans)


def _signature(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen, scale: float,
               num_splits: Optional[int], window: Optional[int], softcap: Optional[float],
               tiles: Optional[DecodeTiles]) -> tuple:
    """What decides a decode call's launches: shapes, strides, dtype, device and 16-byte alignment of q and the
    caches; cache_len's shape, strides, dtype and alignment (a tensor) or value (an int); the arguments; the
    current device."""
    if isinstance(cache_len, torch.Tensor):
        lens = (cache_len.shape, cache_len.stride(), cache_len.dtype, cache_len.data_ptr() % 16 == 0)
    else:
        lens = cache_len
    return (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), q.dtype,
            k_cache.dtype, v_cache.dtype, q.device, q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0,
            v_cache.data_ptr() % 16 == 0, lens, scale, num_splits, window, softcap, tiles,
            torch.cuda.current_device() if q.is_cuda else None)


def decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                  scale: float, num_splits: Optional[int] = None, window: Optional[int] = None,
                  softcap: Optional[float] = None, tiles: Optional[DecodeTiles] = None) -> torch.Tensor:
    """Split-KV decode attention with the Triton kernels; on the GPU, or on the CPU under TRITON_INTERPRET=1.
    num_splits and tiles default to tiles.py's choice for the shapes. Eager decode steps are short: a signature seen
    before runs its plan (docs/flash.md, Decode)."""
    if torch.compiler.is_compiling():  # traced launches belong to the compiler, which keeps no plans
        return _decode(q, k_cache, v_cache, cache_len, scale, num_splits, window, softcap, tiles, traceable=True)[0]
    key = _signature(q, k_cache, v_cache, cache_len, scale, num_splits, window, softcap, tiles)
    plan = _plans.get(key)
    if plan is not None:
        return plan(q, k_cache, v_cache, cache_len)
    o, plan = _decode(q, k_cache, v_cache, cache_len, scale, num_splits, window, softcap, tiles)
    if plan is not None:
        _keep(_plans, key, plan)
    return o


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen, scale: float,
            num_splits: Optional[int], window: Optional[int], softcap: Optional[float],
            tiles: Optional[DecodeTiles] = None, traceable: bool = False) -> tuple[torch.Tensor, Optional[DecodePlan]]:
    """decode_triton() by the general path: o, and the plan that repeats the call (None where there can be none:
    traced launches, more than 4 dims, or tensors on another device than the current)."""
    q4, k4, v4 = as_bhsd(q), as_bhsd(k_cache), as_bhsd(v_cache)
    batch, heads, n_new, d = q4.shape
    kv_heads, max_len = k4.shape[1], k4.shape[2]
    group = heads // kv_heads
    block_m = max(16, min(MAX_BLOCK_M, _block_d(group * n_new)))  # a power of two >= 16: tensor-core dots
    row_blocks = _cdiv(group * n_new, block_m)
    tiles = tiles or _tiles(q)
    keys = max_len if window is None else min(max_len, window + n_new - 1)  # the most a row block can see
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads * row_blocks, keys, q.device, tiles)
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    tiles = tiles.for_chunks(keys, num_splits)
    lens, stride_lb, stride_lh, fixed_len, lens_tensor = _length_args(cache_len, q, q4)
    o = empty_like(q)
    o4 = as_bhsd(o)
    rows = batch * heads * n_new
    lse_offset = rows * num_splits * d
    direct = num_splits == 1
    part = o4 if direct else empty((lse_offset + rows * num_splits,), torch.float32, q.device)  # outputs, then lse
    # Softcap: the base-2 scores are cap_log2e * tanh(cap_scale * q.k), so the plain scale is not applied.
    log2e = 1.4426950408889634
    qk_scale, cap_scale, cap_log2e = (scale * log2e, 0.0, 0.0) if softcap is None else (
        1.0, scale / softcap, softcap * log2e)
    kernels = _kernels()
    # The interpreter takes no launch options.
    partial_options = {} if _interpreting() else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    block_d = _block_d(d)
    with on_device_of(q):
        partial = _run(kernels.decode_partial_kernel, (batch * kv_heads, num_splits, row_blocks),
                       (q4, k4, v4, lens, part, o4, *q4.stride(), *k4.stride(), *v4.stride(), *o4.stride(),
                        stride_lb, stride_lh, fixed_len, lse_offset, kv_heads, n_new, d, num_splits, qk_scale,
                        window or 0, cap_scale, cap_log2e), 6,
                       {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_D": block_d,
                        "IEEE": q.dtype == torch.float32, "LENS_TENSOR": lens_tensor, "WINDOW": window is not None,
                        "SOFTCAP": softcap is not None, "DIRECT": direct}, partial_options, traceable)
        combine = None if direct else _run(
            kernels.decode_combine_kernel, (rows,), (part, o4, *o4.stride(), lse_offset, heads, n_new, d, num_splits),
            2, {"BLOCK_S": _block_d(num_splits), "BLOCK_D": block_d}, {}, traceable)
    if traceable or not plannable(q, k_cache, v_cache):
        return o, None
    return o, DecodePlan(partial, combine, 0 if direct else part.numel())


def decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    """None when decode_triton runs these inputs (with the backend's environment check), else why not."""
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        return (f"head dim {q.shape[-1]} is not supported: flash's decode needs {MIN_HEAD_DIM} <= d_head <= "
                f"{MAX_HEAD_DIM}")
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} is not supported: flash's decode needs float16, bfloat16 or float32"
    if q.device.type == "cpu" and not _interpreting():
        return "CPU tensors need TRITON_INTERPRET=1 (set before the kernels load); otherwise pass CUDA tensors"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} is not supported: flash needs CUDA (or CPU with TRITON_INTERPRET=1)"
    return None


register_decode("flash", input_check=decode_problem, variants=("gqa", "window", "softcap"))(decode_triton)
register_decode("flash-torch", variants=("gqa", "window", "softcap"))(decode_split_torch)
