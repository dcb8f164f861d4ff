"""flash's split-KV decode kernels in Triton (flash-decoding); the host side is attention/flash/decode/host.py.

Decoding is bound by reading the cache, so each cache head is read once for all the query rows that attend to it:
the GROUP query heads of a GQA group times the n_new new tokens. `decode_partial_kernel` runs one program per
(sequence, cache head, row block, split): it holds those rows as one (BLOCK_M, d) tile (padded to at least 16 rows,
so both products are tensor-core dots), streams its chunk of the cache past them, and writes every row's normalised
partial output and log-sum-exp (with one split, the output itself); `decode_combine_kernel` merges a row's chunks,
weighting each by exp(lse_chunk - lse_row). Scores are in the log2 domain (the scale is multiplied by log2(e)) so
the exponentials are exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_partial_kernel(
    Q, K, V, LENS, PART, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, fixed_len, lse_offset,
    n_kv_heads, n_new, head_dim, n_splits, qk_scale, window, cap_scale, cap_log2e,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr, LENS_TENSOR: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, DIRECT: tl.constexpr = False,
):
    """LENS (batch, heads) at strides stride_lb, stride_lh, or fixed_len for every row (LENS_TENSOR false);
    PART holds the partial outputs (rows, n_splits, head_dim) and from lse_offset on their log-sum-exps (rows,
    n_splits); DIRECT (one split): the output goes straight to O instead, and PART is not touched; window: keys
    within it of the query (WINDOW); softcap: the base-2 scores become cap_log2e * tanh(cap_scale * q.k)
    (SOFTCAP)."""
    bkv = tl.program_id(0)  # (sequence, cache head) flattened
    split = tl.program_id(1)
    b = (bkv // n_kv_heads).to(tl.int64)  # int64: a batch of long caches spans more than 2^31 elements
    kvh = (bkv % n_kv_heads).to(tl.int64)
    # Row r of the group's GROUP * n_new: query head kvh * GROUP + r // n_new, new token r % n_new.
    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = offs_r < GROUP * n_new
    h = kvh * GROUP + offs_r // n_new
    j = offs_r % n_new
    if LENS_TENSOR:
        lens = tl.load(LENS + b * stride_lb + h * stride_lh, mask=real, other=0).to(tl.int32)
    else:
        lens = tl.zeros([BLOCK_M], dtype=tl.int32) + fixed_len
    # Each row sees keys first..visible-1: everything before the new tokens and the new ones up to its own.
    visible = lens - n_new + j + 1
    first = visible * 0
    if WINDOW:  # only the last `window` of them
        first = tl.maximum(visible - window, 0)
    # The block's keys, split into chunks of whole tiles (only the last tile is partial).
    lo_all = tl.min(tl.where(real, first, 2147483647), axis=0)
    hi_all = tl.max(tl.where(real, visible, 0), axis=0)
    chunk = tl.cdiv(tl.cdiv(hi_all - lo_all, n_splits), BLOCK_N) * BLOCK_N
    lo = lo_all + split * chunk
    hi = tl.minimum(lo + chunk, hi_all)
    row_hi = tl.minimum(visible, hi)  # padding rows see nothing: visible <= 0

    # IEEE: fp32 inputs are multiplied in fp32, not TF32.
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + j[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=real[:, None] & mask_d[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)  # running max of the scores
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running sum of exp2(score - m) * v
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        k = tl.load(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        # fp32 even where a compiler passes the scale as an fp64 scalar (Inductor does).
        s = (s * qk_scale).to(tl.float32)
        if SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1), exact at both ends
            s = cap_log2e * (1.0 - 2.0 / (tl.exp2(s * cap_scale * 2.8853900817779268) + 1.0))
        seen = (offs_n[None, :] < row_hi[:, None]) & (offs_n[None, :] >= first[:, None])
        s = tl.where(seen, s, -float("inf"))
        # A row may see none of this tile (padding, or rows whose keys end or start elsewhere): keep its max at
        # -inf but subtract 0, so its p and alpha stay 0 rather than NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    # A row that saw no key of this chunk weighs nothing in the combine.
    nonempty = l > 0
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), -float("inf"))
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    if DIRECT:  # the only chunk: its normalised output is the row's
        tl.store(O + b * stride_ob + h[:, None] * stride_oh + j[:, None] * stride_om + offs_d[None, :] * stride_od,
                 o.to(O.dtype.element_ty), mask=real[:, None] & mask_d[None, :])
    else:
        # Rows in (sequence, head, new token) order; int64: rows x splits x d_head may pass 2^31.
        part = (bkv.to(tl.int64) * GROUP * n_new + offs_r) * n_splits + split
        tl.store(PART + part[:, None] * head_dim + offs_d[None, :], o, mask=real[:, None] & mask_d[None, :])
        tl.store(PART + lse_offset + part, lse, mask=real)


@triton.jit
def decode_combine_kernel(
    PART, O,
    stride_ob, stride_oh, stride_om, stride_od,
    lse_offset, n_heads, n_new, head_dim, n_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: rows x splits x d_head may pass 2^31
    bh = row // n_new
    j = row % n_new
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    mask_d = offs_d < head_dim
    lse = tl.load(PART + lse_offset + row * n_splits + offs_s, mask=mask_s, other=-float("inf"))
    # Every row sees at least one key, so some chunk's lse and the row's max are finite.
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (BLOCK_S,), 0 for empty chunks
    parts = tl.load(PART + (row * n_splits + offs_s[:, None]) * head_dim + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    o = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(O + b * stride_ob + h * stride_oh + j * stride_om + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=mask_d)
