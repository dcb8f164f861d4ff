"""flash's split-KV decode kernels in Triton (flash-decoding); the host side is attention/flash/decode/host.py.

One query row (a (sequence, head, new token)) reads its visible keys once. With few rows (batch 1: one per head)
the grid would be far smaller than the GPU, so the visible length is split into `num_splits` chunks, one program
each: `decode_partial_kernel` writes every chunk's normalised partial output and its log-sum-exp, and
`decode_combine_kernel` merges a row's chunks, weighting each by exp(lse_chunk - lse_row). Scores are in the log2
domain (the scale is multiplied by log2(e)) so the exponentials are exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_partial_kernel(
    Q, K, V, LENS, O_PART, LSE_PART,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    n_heads, n_new, head_dim, qk_scale, group, window, cap_scale, cap_log2e,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """group: query heads per cache head (GQA); window: keys within it of the query (WINDOW); softcap: the base-2
    scores become cap_log2e * tanh(cap_scale * q.k) (SOFTCAP)."""
    row = tl.program_id(0)  # (sequence, head, new token) flattened
    split = tl.program_id(1)
    bh = row // n_new
    j = row % n_new
    b = (bh // n_heads).to(tl.int64)  # int64: a batch of long caches spans more than 2^31 elements
    h = (bh % n_heads).to(tl.int64)
    # Keys 0..visible-1: everything before the new tokens, and the new ones up to this query.
    visible = tl.load(LENS + bh).to(tl.int32) - n_new + j + 1
    first = visible * 0
    if WINDOW:  # only the last `window` of them
        first = tl.maximum(visible - window, 0)
    # Chunks are whole key tiles, so only the visible length's last tile is partial.
    chunk = tl.cdiv(tl.cdiv(visible - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, visible)

    # The query padded to 16 rows (row 0 is real): both products are then tensor-core dots, whose loads Triton
    # pipelines (num_stages); elementwise products read the cache slower (docs/flash.md, Decode). IEEE: fp32 inputs
    # are multiplied in fp32, not TF32.
    offs_m = tl.arange(0, 16)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + j * stride_qm + offs_m[:, None] * 0 + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] == 0) & mask_d[None, :], other=0.0)
    k_base = K + b * stride_kb + (h // group) * stride_kh  # GQA: a group of query heads reads one cache head
    v_base = V + b * stride_vb + (h // group) * stride_vh
    m = tl.full([16], -float("inf"), dtype=tl.float32)  # running max of the scores
    l = tl.zeros([16], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([16, BLOCK_D], dtype=tl.float32)  # running sum of exp2(score - m) * v
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
        s = tl.where(mask_n[None, :], s, -float("inf"))
        # Every tile starts below hi, so it has a visible key and m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    # A chunk past the visible length (short rows) is empty: weight 0 in the combine.
    nonempty = l > 0
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), -float("inf"))
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    part = row * NUM_SPLITS + split
    tl.store(O_PART + part * head_dim + offs_m[:, None] * 0 + offs_d[None, :], o,
             mask=(offs_m[:, None] == 0) & mask_d[None, :])
    tl.store(LSE_PART + part + offs_m * 0, lse, mask=offs_m == 0)


@triton.jit
def decode_combine_kernel(
    O_PART, LSE_PART, O,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, n_new, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    bh = row // n_new
    j = row % n_new
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < head_dim
    lse = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=mask_s, other=-float("inf"))
    # The first chunk always holds a visible key (key 0, or the window's first), so the row's max is finite.
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (BLOCK_S,), 0 for empty chunks
    parts = tl.load(O_PART + (row * NUM_SPLITS + offs_s[:, None]) * head_dim + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    o = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(O + b * stride_ob + h * stride_oh + j * stride_om + offs_d * stride_od,
             o.to(O.dtype.element_ty), mask=mask_d)
