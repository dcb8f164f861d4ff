"""The Triton kernels of `flash` (FlashAttention-2); the host code is in host.py, the design in docs/flash.md.

Imported lazily by host.py on first use: `triton.jit` decides at decoration time whether a kernel
runs on the GPU or in the CPU interpreter, so TRITON_INTERPRET must be set before this module loads.

Every attention kernel sees one (batch, head) slice per program along grid axis 1 and tiles along axis 0.
Naming, for all kernels: M indexes queries, N indexes keys, D the head dim (padded to BLOCK_D, a power
of two; D is the real head dim). Base offsets and row offsets are int64, so tensors beyond 2^31
elements address correctly. Scores are kept in the base-2 domain: qk_scale = scale * log2(e), so
exp(scale * s) == exp2(qk_scale * s); L is stored as a natural log and converted where it is used.

Variants (attention/registry.py), each a constexpr flag, so the plain kernels compile exactly as without them:
GROUP > 1 (GQA): query head h reads key/value head h // GROUP; the dK/dV program of a key/value head loops over its
group's query heads (a sum without atomics, in a fixed order). WINDOW, DOCS: per tile, the range of keys (queries,
for dK/dV) that some row sees, and the part that every row sees whole, come from the window and from the document
bounds START/END (int32 (batch, seq): where each position's document starts and ends); tiles outside the range are
never visited, the whole ones run unmasked, only the tiles between are masked. SOFTCAP: the base-2 scores become
cap_log2e * tanh(cap_scale * q.k) (the host passes qk_scale = 1), and dS gets the factor 1 - tanh^2.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The mode the kernels below were decorated in (fixed for the life of the process).
INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows past n_rows and padded head-dim columns read as 0.

    The masks are compile-time decisions: a full tile of a power-of-two head dim loads with no mask.
    """
    if CHECK_ROWS:
        if BLOCK_D == D:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)
    else:
        if BLOCK_D == D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows, n_rows, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == D:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D))


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x -> inf gives 1, -> 0 gives -1), an absolute error of
    # about one fp32 ulp near 0, which is what the capped score needs.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _visible(q_idx, k_idx, q_start, k_start, N_K, window,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Whether query q_idx sees key k_idx (broadcast shapes); q_start, k_start: their documents' first positions."""
    keep = k_idx < N_K
    if CAUSAL:
        keep = keep & (k_idx <= q_idx)
    if WINDOW:
        if CAUSAL:
            keep = keep & (q_idx - k_idx < window)
        else:
            keep = keep & (q_idx - k_idx < window) & (k_idx - q_idx < window)
    if DOCS:
        keep = keep & (q_start == k_start)
    return keep


@triton.jit
def _whole_tiles(lo, full_lo, full_hi, hi, first, last, START, END, DOCS: tl.constexpr, BLOCK: tl.constexpr):
    """The ranges of _key_bounds and _query_bounds, cut to the documents of a tile's first and last positions and
    rounded to tiles of BLOCK: [lo, hi) outward, [full_lo, full_hi) inward."""
    if DOCS:
        lo = tl.maximum(lo, tl.load(START + first))
        hi = tl.minimum(hi, tl.load(END + last))
        full_lo = tl.maximum(full_lo, tl.load(START + last))
        full_hi = tl.minimum(full_hi, tl.load(END + first))
    lo = (lo // BLOCK) * BLOCK
    full_lo = ((full_lo + BLOCK - 1) // BLOCK) * BLOCK
    full_hi = (full_hi // BLOCK) * BLOCK
    # Clamped into [lo, hi) with full_lo <= full_hi: without whole tiles the masked loops cover [lo, hi). (min and
    # max rather than tl.where: the interpreter of triton 3.6 makes a 1-element array of a where on scalars.)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_bounds(m0, N_Q, N_K, window, START, END,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query tile at m0: key tiles [lo, hi) hold every key some row sees; [full_lo, full_hi) (whole
    BLOCK_N tiles) only keys that every row sees. Beyond causal, only with a window or documents."""
    m_last = tl.minimum(m0 + BLOCK_M, N_Q) - 1
    lo = m0 * 0
    full_lo = m0 * 0
    hi = N_K + m0 * 0
    full_hi = N_K + m0 * 0
    if CAUSAL:
        hi = tl.minimum(m_last + 1, N_K)
        full_hi = tl.minimum(m0 + 1, N_K)
    if WINDOW:
        lo = tl.maximum(m0 - window + 1, 0)
        full_lo = tl.maximum(m_last - window + 1, 0)
        if not CAUSAL:
            hi = tl.minimum(hi, m_last + window)
            full_hi = tl.minimum(full_hi, m0 + window)
    # Documents are runs of positions: the rows see keys from m0's document to m_last's.
    return _whole_tiles(lo, full_lo, full_hi, hi, m0, m_last, START, END, DOCS, BLOCK_N)


@triton.jit
def _query_tile_keys(offs_m, m0, b, N_Q, N_K, window, START, END,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query tile at m0 of sequence b: each row's document start (its own position without documents),
    START moved to sequence b's bounds, and _key_bounds' key tile ranges (lo, full_lo, full_hi, hi)."""
    row_start = offs_m
    if DOCS:
        START += b * N_Q
        END += b * N_Q
        row_start = tl.load(START + offs_m, mask=offs_m < N_Q, other=-2)
    lo, full_lo, full_hi, hi = _key_bounds(m0, N_Q, N_K, window, START, END, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N)
    return row_start, START, lo, full_lo, full_hi, hi


@triton.jit
def _query_bounds(n0, N_Q, N_K, window, START, END,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the key tile at n0, as _key_bounds for queries: [lo, hi) some query sees a key of it, [full_lo,
    full_hi) (whole BLOCK_M tiles) every query sees all of them."""
    n_last = tl.minimum(n0 + BLOCK_N, N_K) - 1
    lo = n0 * 0
    full_lo = n0 * 0
    hi = N_Q + n0 * 0
    full_hi = N_Q + n0 * 0
    if CAUSAL:
        lo = n0
        full_lo = n_last
    if WINDOW:
        hi = tl.minimum(hi, n_last + window)
        full_hi = tl.minimum(full_hi, n0 + window)
        if not CAUSAL:
            lo = tl.maximum(n0 - window + 1, 0)
            full_lo = tl.maximum(n_last - window + 1, 0)
    return _whole_tiles(lo, full_lo, full_hi, hi, n0, n_last, START, END, DOCS, BLOCK_M)


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHECK_KEYS: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False, VARIANT_MASK: tl.constexpr = False, CAUSAL: tl.constexpr = False,
    WINDOW: tl.constexpr = False, DOCS: tl.constexpr = False,
):
    """Online softmax over key tiles [lo, hi): the running max m_i, sum l_i and unnormalised output acc.

    VARIANT_MASK: mask each score by _visible (causal, window, documents, keys past N_K); a row may then have seen
    no key yet, and its max stays -inf."""
    k_ptrs = K + (lo + offs_n).to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + (lo + offs_n).to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, N_K, offs_d, D, BLOCK_D, CHECK_KEYS)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if SOFTCAP:
            s = cap_log2e * _tanh(s * cap_scale)  # base-2 scores already; qk_scale is 1
        if VARIANT_MASK:
            col_start = cols
            if DOCS:
                col_start = tl.load(START + cols, mask=cols < N_K, other=-1)
            keep = _visible(offs_m[:, None], cols[None, :], row_start[:, None], col_start[None, :], N_K, window,
                            CAUSAL, WINDOW, DOCS)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            # Rows that have seen no key yet keep m = -inf: shift them by 0, so that p and alpha are 0, not NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s * qk_scale - shift[:, None])
            alpha = tl.exp2(m_i - shift)
        else:
            if CAUSAL_MASK:
                # Only the diagonal band gets here. For real rows (< N_Q == N_K) this also masks keys past N_K.
                s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
            elif CHECK_KEYS:
                s = tl.where(cols[None, :] < N_K, s, float("-inf"))
            # scale > 0 (checked on the host), so max(s) * qk_scale == max(s * qk_scale) and the subtraction
            # below fuses into one FMA per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptrs, cols, N_K, offs_d, D, BLOCK_D, CHECK_KEYS)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, O, L, START, END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, N_Q, N_K, qk_scale, cap_scale, cap_log2e, window,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O = softmax(scale q k^T) v for one query tile of one (batch, head); L = logsumexp (natural log)."""
    # Inductor passes Python floats as fp64 when it launches the kernel (flash_op under torch.compile); fp64 scores
    # would promote the whole softmax and the accumulator.
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_scale, cap_log2e = tl.cast(cap_scale, tl.float32), tl.cast(cap_log2e, tl.float32)
    # Causal: the last query tiles do the most work, so launch them first for a better tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    O += b * stride_ob + h * stride_oh
    L += bh.to(tl.int64) * N_Q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(
        Q + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        offs_m, N_Q, offs_d, D, BLOCK_D, True,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW or DOCS:
        # Masked tiles [lo, full_lo), whole ones [full_lo, full_hi), masked [full_hi, hi); the rest skipped.
        row_start, START, lo, full_lo, full_hi, hi = _query_tile_keys(
            offs_m, pid_m * BLOCK_M, b, N_Q, N_K, window, START, END, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, lo, full_lo, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_lo, full_hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP, False, CAUSAL, WINDOW, DOCS,
        )
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_hi, hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
        l_i = tl.where(offs_m < N_Q, l_i, 1.0)  # rows past N_Q may have seen no key; they are not stored
    elif CAUSAL:
        # Key tiles left of the query tile see every key: no mask. BLOCK_M % BLOCK_N == 0, so the band
        # [diag_lo, diag_lo + BLOCK_M) is whole key tiles; tiles right of it are skipped entirely.
        diag_lo = pid_m * BLOCK_M
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, diag_lo, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP,
        )
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, diag_lo, tl.minimum(diag_lo + BLOCK_M, N_K), N_K, qk_scale, cap_scale,
            cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, True, True, DOT_PRECISION, SOFTCAP,
        )
    else:
        full_hi = (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, full_hi, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP,
        )
        # The ragged last key tile, if any (zero or one iteration).
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_hi, N_K, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP,
        )

    # Every real row saw at least one key (causal row r sees key r; windows and documents include the row itself,
    # and the registry refuses a non-causal window that leaves a row without keys), so l_i > 0.
    o = acc / l_i[:, None]
    _store_tile(
        O + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od,
        o.to(O.dtype.element_ty), offs_m, N_Q, offs_d, D, BLOCK_D,
    )
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # log2 -> natural log
    tl.store(L + offs_m, lse, mask=offs_m < N_Q)


# ----------------------------------------------------------------------------------------------------------
# The order of the Hopper forward's work items with documents (hopper/kernels.py, _work_item)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def work_order(START, END, ORDER, ITEMS, N, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr,
               TILE: tl.constexpr, BLOCK: tl.constexpr):
    """ORDER[r] = the work item of rank r, most streamed tiles first, ties in item order (a stable descending sort,
    by counting). Item i is block i % blocks of ROWS query rows of sequence i // blocks, documents bounded by START
    and END; its cost, the key tiles of TILE rows it streams (_key_bounds). Each program ranks BLOCK items against
    all ITEMS."""
    offs_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cost_i = _streamed_tiles(offs_i, ITEMS, N, window, START, END, CAUSAL, WINDOW, ROWS, TILE)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, ITEMS, BLOCK):
        offs_j = j0 + tl.arange(0, BLOCK)
        cost_j = _streamed_tiles(offs_j, ITEMS, N, window, START, END, CAUSAL, WINDOW, ROWS, TILE)
        ahead = (cost_j[None, :] > cost_i[:, None]) | ((cost_j[None, :] == cost_i[:, None]) &
                                                        (offs_j[None, :] < offs_i[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(ORDER + rank, offs_i, mask=offs_i < ITEMS)


@triton.jit
def _streamed_tiles(items, ITEMS, N, window, START, END, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    ROWS: tl.constexpr, TILE: tl.constexpr):
    """Key tiles each item streams, -1 past the last item (ranked after every item)."""
    valid = items < ITEMS
    items = tl.where(valid, items, 0)
    blocks = tl.cdiv(N, ROWS)
    seq = items // blocks
    lo, _, _, hi = _key_bounds((items % blocks) * ROWS, N, N, window, START + seq * N, END + seq * N, CAUSAL,
                               WINDOW, True, ROWS, TILE)
    return tl.where(valid, (hi - lo + TILE - 1) // TILE, -1)


# ----------------------------------------------------------------------------------------------------------
# Backward: dQ (program per query tile; it writes delta), then dK/dV (program per key tile). No atomics. The delta
# pre-pass is the Hopper backward's, whose dK/dV and dQ kernels run side by side.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _accumulator_rows(ACC, bh, offs_m, offs_d, N_Q, D: tl.constexpr):
    """The addresses of (batch, head) bh's dQ at rows offs_m, columns offs_d, as a (rows, columns) tile, in the fused
    Hopper backward's fp32 (batch * heads, N_Q, D) accumulator."""
    return ACC + (bh.to(tl.int64) * N_Q + offs_m.to(tl.int64)[:, None]) * D + offs_d[None, :]


@triton.jit
def attn_bwd_delta(
    O, DO, DELTA, ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, N_Q,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_ACC: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32: the softmax-backward term shared by every key of a row (Hopper backward).
    ZERO_ACC: also zero the same rows of the fused backward's (batch * heads, N_Q, D) fp32 dQ accumulator ACC, which
    saves that backward a launch."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    o = _load_tile(O + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
                   offs_m, N_Q, offs_d, D, BLOCK_D, True)
    do = _load_tile(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, N_Q, offs_d, D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)
    if ZERO_ACC:
        tl.store(_accumulator_rows(ACC, bh, offs_m, offs_d, N_Q, D), tl.zeros((BLOCK_M, BLOCK_D), tl.float32),
                 mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < D))


@triton.jit
def dq_from_accumulator(
    ACC, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    H, N_Q, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dQ = scale * ACC in dQ's dtype and memory order, ACC the fused Hopper backward's fp32 (batch * heads, N_Q, D)
    accumulator."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < N_Q
    dq = tl.load(_accumulator_rows(ACC, bh, offs_m, offs_d, N_Q, D), mask=rows[:, None]) * scale
    dq_rows = DQ + b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
    tl.store(dq_rows + offs_d[None, :] * stride_qd, dq.to(DQ.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _dkdv_q_loop(
    dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, offs_m, offs_d, lo, hi, N_Q, qk_scale, cap_scale, cap_log2e, N_K, window, key_start, START,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    CHECK_ROWS: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False, VARIANT_MASK: tl.constexpr = False, CAUSAL: tl.constexpr = False,
    WINDOW: tl.constexpr = False, DOCS: tl.constexpr = False,
):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), working with transposed scores."""
    q_ptrs = Q + (lo + offs_m).to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + (lo + offs_m).to(tl.int64)[:, None] * stride_dom + offs_d[None, :] * stride_dod
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = _load_tile(q_ptrs, rows, N_Q, offs_d, D, BLOCK_D, CHECK_ROWS)
        if CHECK_ROWS:
            # Rows past N_Q get L = +inf, so their probabilities are exactly 0 and they add nothing.
            lse = tl.load(L + rows, mask=rows < N_Q, other=float("inf"))
            delta = tl.load(DELTA + rows, mask=rows < N_Q, other=0.0)
        else:
            lse = tl.load(L + rows)
            delta = tl.load(DELTA + rows)
        do = _load_tile(do_ptrs, rows, N_Q, offs_d, D, BLOCK_D, CHECK_ROWS)
        # Order matters on Hopper: Triton waits for a wgmma at once unless its result only accumulates (dv, dk),
        # so both score matmuls go first and dS is computed while the dV matmul runs
        # (faster than S, P, dV, dP, dS, dK at each shape's best tiles: docs/flash.md, Algorithm).
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if SOFTCAP:
            tanh_t = _tanh(s_t * cap_scale)
            s_t = cap_log2e * tanh_t
        p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
        if VARIANT_MASK:
            row_start = rows
            if DOCS:
                row_start = tl.load(START + rows, mask=rows < N_Q, other=-2)
            keep = _visible(rows[None, :], offs_n[:, None], row_start[None, :], key_start[:, None], N_K, window,
                            CAUSAL, WINDOW, DOCS)
            p_t = tl.where(keep, p_t, 0.0)
        elif CAUSAL_MASK:
            p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)  # d(c tanh(s / c)) / ds
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _dkdv_one_head(
    dk, dv, k, v, Q, DO, L, DELTA, START, END, stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, offs_m, offs_d, pid_n, N_Q, N_K, qk_scale, cap_scale, cap_log2e, window,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Add the contributions of one query head's rows (Q, DO, L, DELTA at that head) to a key tile's dK, dV."""
    full_q_hi = (N_Q // BLOCK_M) * BLOCK_M  # query tiles below this need no row mask
    if WINDOW or DOCS:
        key_start = offs_n
        if DOCS:
            key_start = tl.load(START + offs_n, mask=offs_n < N_K, other=-1)
        lo, full_lo, full_hi, hi = _query_bounds(pid_n * BLOCK_N, N_Q, N_K, window, START, END,
                                                 CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, lo, full_lo, N_Q, qk_scale, cap_scale, cap_log2e, N_K, window, key_start, START,
            D, BLOCK_D, BLOCK_M, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, full_lo, full_hi, N_Q, qk_scale, cap_scale, cap_log2e, N_K, window, key_start,
            START, D, BLOCK_D, BLOCK_M, False, False, DOT_PRECISION, SOFTCAP, False, CAUSAL, WINDOW, DOCS,
        )
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, full_hi, hi, N_Q, qk_scale, cap_scale, cap_log2e, N_K, window, key_start, START,
            D, BLOCK_D, BLOCK_M, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
    elif CAUSAL:
        # Queries above the key tile see none of its keys: skipped. BLOCK_N % BLOCK_M == 0, so the band
        # of query rows [band_lo, band_hi) that straddles the diagonal is whole query tiles.
        band_lo = pid_n * BLOCK_N
        band_hi = band_lo + BLOCK_N
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, band_lo, tl.minimum(band_hi, N_Q), N_Q, qk_scale, cap_scale, cap_log2e, N_K,
            window, offs_n, START, D, BLOCK_D, BLOCK_M, True, True, DOT_PRECISION, SOFTCAP,
        )
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, band_hi, full_q_hi, N_Q, qk_scale, cap_scale, cap_log2e, N_K,
            window, offs_n, START, D, BLOCK_D, BLOCK_M, False, False, DOT_PRECISION, SOFTCAP,
        )
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, tl.maximum(band_hi, full_q_hi), N_Q, N_Q, qk_scale, cap_scale, cap_log2e, N_K,
            window, offs_n, START, D, BLOCK_D, BLOCK_M, True, False, DOT_PRECISION, SOFTCAP,
        )
    else:
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, 0, full_q_hi, N_Q, qk_scale, cap_scale, cap_log2e, N_K,
            window, offs_n, START, D, BLOCK_D, BLOCK_M, False, False, DOT_PRECISION, SOFTCAP,
        )
        dk, dv = _dkdv_q_loop(
            dk, dv, k, v, Q, DO, L, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_m, offs_d, full_q_hi, N_Q, N_Q, qk_scale, cap_scale, cap_log2e, N_K,
            window, offs_n, START, D, BLOCK_D, BLOCK_M, True, False, DOT_PRECISION, SOFTCAP,
        )
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, L, DELTA, DK, DV, START, END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N_Q, N_K, qk_scale, scale, cap_scale, cap_log2e, window,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one key tile of one (batch, key/value head): k and v stay on chip, the query tiles of each query
    head of its group stream past (GROUP of them, one after another: no atomics, a fixed order of the sum)."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 from Inductor, see attn_fwd
    cap_scale, cap_log2e = tl.cast(cap_scale, tl.float32), tl.cast(cap_log2e, tl.float32)
    pid_n = tl.program_id(0)  # causal: the first key tiles have the most query tiles, and launch first
    bh_kv = tl.program_id(1)
    H_KV = H // GROUP
    b = (bh_kv // H_KV).to(tl.int64)
    h_kv = (bh_kv % H_KV).to(tl.int64)
    K += b * stride_kb + h_kv * stride_kh
    V += b * stride_vb + h_kv * stride_vh
    DK += b * stride_dkb + h_kv * stride_dkh
    DV += b * stride_dvb + h_kv * stride_dvh
    if DOCS:
        START += b * N_Q
        END += b * N_Q

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_n = offs_n.to(tl.int64)[:, None]
    k = _load_tile(K + rows_n * stride_kn + offs_d[None, :] * stride_kd, offs_n, N_K, offs_d, D, BLOCK_D, True)
    v = _load_tile(V + rows_n * stride_vn + offs_d[None, :] * stride_vd, offs_n, N_K, offs_d, D, BLOCK_D, True)
    # Keys past N_K load as 0; their dK/dV rows are computed but never stored, and rows do not mix.
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    if GROUP == 1:
        h = h_kv
        dk, dv = _dkdv_one_head(
            dk, dv, k, v, Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh,
            L + (b * H + h) * N_Q, DELTA + (b * H + h) * N_Q, START, END,
            stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_m, offs_d, pid_n, N_Q, N_K,
            qk_scale, cap_scale, cap_log2e, window,
            D, BLOCK_D, CAUSAL, DOT_PRECISION, WINDOW, SOFTCAP, DOCS, BLOCK_M, BLOCK_N,
        )
    else:
        for g in range(GROUP):
            h = h_kv * GROUP + g
            dk, dv = _dkdv_one_head(
                dk, dv, k, v, Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh,
                L + (b * H + h) * N_Q, DELTA + (b * H + h) * N_Q, START, END,
                stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_m, offs_d, pid_n, N_Q, N_K,
                qk_scale, cap_scale, cap_log2e, window,
                D, BLOCK_D, CAUSAL, DOT_PRECISION, WINDOW, SOFTCAP, DOCS, BLOCK_M, BLOCK_N,
            )

    dk *= scale  # dS was taken w.r.t. the scaled scores
    _store_tile(DK + rows_n * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
                offs_n, N_K, offs_d, D, BLOCK_D)
    _store_tile(DV + rows_n * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
                offs_n, N_K, offs_d, D, BLOCK_D)


@triton.jit
def _dq_kv_loop(
    dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHECK_KEYS: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False, VARIANT_MASK: tl.constexpr = False, CAUSAL: tl.constexpr = False,
    WINDOW: tl.constexpr = False, DOCS: tl.constexpr = False,
):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    k_ptrs = K + (lo + offs_n).to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + (lo + offs_n).to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, N_K, offs_d, D, BLOCK_D, CHECK_KEYS)
        v = _load_tile(v_ptrs, cols, N_K, offs_d, D, BLOCK_D, CHECK_KEYS)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            tanh = _tanh(s * cap_scale)
            s = cap_log2e * tanh
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if VARIANT_MASK:
            col_start = cols
            if DOCS:
                col_start = tl.load(START + cols, mask=cols < N_K, other=-1)
            keep = _visible(offs_m[:, None], cols[None, :], row_start[:, None], col_start[None, :], N_K, window,
                            CAUSAL, WINDOW, DOCS)
            p = tl.where(keep, p, 0.0)
        elif CAUSAL_MASK:
            p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
        elif CHECK_KEYS:
            # A missing key has s = 0, and exp2(-lse2) can overflow when every real score is very negative.
            p = tl.where(cols[None, :] < N_K, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)  # d(c tanh(s / c)) / ds
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, O, DO, L, DELTA, DQ, START, END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, N_Q, N_K, qk_scale, scale, cap_scale, cap_log2e, window,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ for one query tile of one (batch, head): q, dO, L, delta stay on chip, key tiles stream past. It computes
    the tile's delta = rowsum(dO * O) and writes it to DELTA, for the dK/dV kernel launched after it."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 from Inductor, see attn_fwd
    cap_scale, cap_log2e = tl.cast(cap_scale, tl.float32), tl.cast(cap_log2e, tl.float32)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: heaviest query tiles first
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    O += b * stride_ob + h * stride_oh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    L += bh.to(tl.int64) * N_Q
    DELTA += bh.to(tl.int64) * N_Q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows_m = offs_m.to(tl.int64)[:, None]
    q = _load_tile(Q + rows_m * stride_qm + offs_d[None, :] * stride_qd, offs_m, N_Q, offs_d, D, BLOCK_D, True)
    do = _load_tile(DO + rows_m * stride_dom + offs_d[None, :] * stride_dod, offs_m, N_Q, offs_d, D, BLOCK_D, True)
    # Rows past N_Q: L = +inf gives p = 0; they are not stored either way.
    lse2 = tl.load(L + offs_m, mask=offs_m < N_Q, other=float("inf")) * 1.4426950408889634
    o = _load_tile(O + rows_m * stride_om + offs_d[None, :] * stride_od, offs_m, N_Q, offs_d, D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + offs_m, delta, mask=offs_m < N_Q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if WINDOW or DOCS:  # the key tiles of the forward's query tile: masked, whole, masked
        row_start, START, lo, full_lo, full_hi, hi = _query_tile_keys(
            offs_m, pid_m * BLOCK_M, b, N_Q, N_K, window, START, END, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N)
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, lo, full_lo, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_lo, full_hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP, False, CAUSAL, WINDOW, DOCS,
        )
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_hi, hi, N_K, qk_scale, cap_scale, cap_log2e, window, row_start, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP, True, CAUSAL, WINDOW, DOCS,
        )
    elif CAUSAL:
        diag_lo = pid_m * BLOCK_M  # BLOCK_M % BLOCK_N == 0: the band is whole key tiles
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, diag_lo, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP,
        )
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, diag_lo, tl.minimum(diag_lo + BLOCK_M, N_K), N_K, qk_scale, cap_scale,
            cap_log2e, window, offs_m, START, D, BLOCK_D, BLOCK_N, True, True, DOT_PRECISION, SOFTCAP,
        )
    else:
        full_hi = (N_K // BLOCK_N) * BLOCK_N
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, full_hi, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, False, False, DOT_PRECISION, SOFTCAP,
        )
        dq = _dq_kv_loop(
            dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, full_hi, N_K, N_K, qk_scale, cap_scale, cap_log2e, window, offs_m, START,
            D, BLOCK_D, BLOCK_N, True, False, DOT_PRECISION, SOFTCAP,
        )

    dq *= scale
    _store_tile(DQ + rows_m * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
                offs_m, N_Q, offs_d, D, BLOCK_D)
