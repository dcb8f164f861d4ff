"""flash's decode attention: split-KV (flash-decoding), in PyTorch (the readable spec) and in Triton.

Decoding asks one query per sequence and head (q (..., heads, 1, d_head)) to read a long key/value cache: the work
is reading the cache, and at batch 1 there are only `heads` rows to spread over the GPU. So each row's visible keys
are split along their length into `num_splits` chunks; each chunk computes a partial softmax (its output already
normalised, and the log-sum-exp of its scores), and the chunks are combined:

    lse_c = log sum_{i in c} exp(s_i),   o_c = sum_{i in c} exp(s_i - lse_c) v_i
    o = sum_c exp(lse_c - lse) o_c,      lse = log sum_c exp(lse_c)

Chunks are sized from each row's own visible length (rounded up to whole key tiles), so a short row in a batch of
long ones does no wasted reads; a chunk that starts past its row's end is empty and weighs nothing. With a window the
chunks cover only the row's last `window` keys. The inputs, the meaning of cache_len and the variants (GQA, window,
softcap) are those of attention/decode.py; the Triton kernel reads each cache head in place for its group of query
heads.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from attention.decode import CacheLen, capped, lengths, repeat_kv, visible
from attention.flash.common import as_bhsd, on_device_of
from attention.registry import register_decode

try:
    import triton
except ImportError:  # the flash backend reports it through its environment check
    triton = None

BLOCK_N = 128  # keys per tile, in both versions
MAX_SPLITS = 128  # the combine kernel holds all of a row's chunks at once
MIN_CHUNK = 256  # keys per chunk below which another split costs more (partials, combine) than it spreads


MIN_HEAD_DIM = 16  # the dots' smallest dimension
MAX_HEAD_DIM = 256  # a (BLOCK_N, d_head) tile of K and of V stays in registers
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_num_splits(rows: int, max_len: int, device: torch.device) -> int:
    """Chunks per row: enough programs for about four per SM, with chunks of at least MIN_CHUNK keys.

    Depends only on shapes (the cache's capacity, not its filled length), so a captured decode step keeps it.
    """
    if device.type != "cuda":
        return max(1, min(4, max_len // MIN_CHUNK))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, math.ceil(4 * sms / rows), max_len // MIN_CHUNK))


def chunk_bounds(cache_len: CacheLen, q: torch.Tensor, num_splits: int,
                 window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the key range [lo, hi) of every (row, chunk), shaped (..., n_new, num_splits)."""
    n_new = q.shape[-2]
    n_visible = lengths(cache_len, q)[..., None] - n_new + 1 + torch.arange(n_new, device=q.device)
    first = (n_visible - window).clamp(min=0) if window is not None else torch.zeros_like(n_visible)
    chunk = (n_visible - first + num_splits - 1) // num_splits
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = first[..., None] + chunk[..., None] * torch.arange(num_splits, device=q.device)
    return lo, torch.minimum(lo + chunk[..., None], n_visible[..., None])


def decode_split_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                       scale: float, num_splits: int = 4, window: Optional[int] = None,
                       softcap: Optional[float] = None) -> torch.Tensor:
    """Split-KV decode attention in plain PyTorch, chunk by chunk: what the Triton kernels compute."""
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    max_len = k_cache.shape[-2]
    k_cache, v_cache = repeat_kv(k_cache, q), repeat_kv(v_cache, q)
    scores = torch.matmul(q.to(acc_dtype), k_cache.to(acc_dtype).transpose(-2, -1)) * scale  # (..., n_new, max_len)
    scores = capped(scores, softcap)
    lo, hi = chunk_bounds(cache_len, q, num_splits, window)
    pos = torch.arange(max_len, device=q.device)
    partial_o, partial_lse = [], []
    for c in range(num_splits):
        in_chunk = (pos >= lo[..., c, None]) & (pos < hi[..., c, None])  # (..., n_new, max_len)
        s = scores.masked_fill(~in_chunk, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # -inf for an empty chunk
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


def decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: CacheLen,
                  scale: float, num_splits: Optional[int] = None, window: Optional[int] = None,
                  softcap: Optional[float] = None) -> torch.Tensor:
    """Split-KV decode attention with the Triton kernels; on the GPU, or on the CPU under TRITON_INTERPRET=1."""
    q4, k4, v4 = as_bhsd(q), as_bhsd(k_cache), as_bhsd(v_cache)
    batch, heads, n_new, d = q4.shape
    rows = batch * heads * n_new
    if num_splits is None:
        num_splits = default_num_splits(rows, k4.shape[-2], q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    lens = lengths(cache_len, q).reshape(batch, heads).contiguous()  # one int per (sequence, head)
    o = torch.empty_like(q4)
    partial_o = torch.empty(rows, num_splits, d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(rows, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    kernels = _kernels()
    # 128-key tiles, 4 warps and 3 stages read the cache fastest of those tried (docs/flash.md, Decode). The
    # interpreter takes no launch options.
    options = {} if _interpreting() else {"num_warps": 4, "num_stages": 3}
    # Softcap: the base-2 scores are cap_log2e * tanh(cap_scale * q.k), so the plain scale is not applied.
    log2e = math.log2(math.e)
    qk_scale, cap_scale, cap_log2e = (scale * log2e, 0.0, 0.0) if softcap is None else (
        1.0, scale / softcap, softcap * log2e)
    with on_device_of(q):
        kernels.decode_partial_kernel[(rows, num_splits)](
            q4, k4, v4, lens, partial_o, partial_lse,
            *q4.stride(), *k4.stride(), *v4.stride(),
            heads, n_new, d, qk_scale, heads // k4.shape[1], window or 0, cap_scale, cap_log2e,
            NUM_SPLITS=num_splits, BLOCK_N=BLOCK_N, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
            WINDOW=window is not None, SOFTCAP=softcap is not None, **options)
        kernels.decode_combine_kernel[(rows,)](
            partial_o, partial_lse, o, *o.stride(), heads, n_new, d,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            **({} if _interpreting() else {"num_warps": 4}))
    return o.reshape(q.shape)


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
