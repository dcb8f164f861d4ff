"""flash's Hopper (sm_90) kernels, written in Gluon: the forward, dK/dV and dQ. The host code is in host.py.

Triton 3.6 waits for a score matmul as soon as its result is read, so in flash's Triton kernels the softmax never
runs beside a matmul. Gluon states the schedule instead of leaving it to
the compiler. Every kernel has the same shape: a producer warp streams tiles of two tensors into a ring of STAGES
shared-memory slots with TMA, and each of NUM_CONSUMERS consumer warpgroups keeps BLOCK_M (64) rows of its own
resident, issues the matmuls of the next streamed tile asynchronously, and does its elementwise work while the
matmuls of the tile before still run on the tensor cores (FlashAttention-3's intra-warpgroup overlap). A slot is
free again once every consumer has arrived on its `empty` barrier, after the last matmul that reads it retired.

The forward keeps query rows and streams key and value tiles. For key tile j it issues S_j = Q K_j^T and then
the previous tile's O += P_{j-1} V_{j-1}, waits only for S_j, and computes the softmax of S_j while the P V matmul
runs. O is rescaled after that matmul retires: O then holds the sum up to tile j-1 at tile j's running max.

Scores are in the base-2 domain (qk_scale = scale * log2 e) as in triton/kernels.py; L is the natural-log
logsumexp that the backward reads.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)
# Triton 3.9 renamed the TMA copies (async_load, async_store) and made the old names raise; 3.6 has only the old ones.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier among the warps of the calling partition (3.9: gl.barrier; 3.6: gl.thread_barrier).
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def _tma_add_from_builder(tensor_desc, coord, src, _semantic=None):
    """Adds a shared-memory tile into global memory with one TMA reduction (cp.reduce.async.bulk.tensor .add)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# Triton 3.9 names the TMA reduction tma.async_atomic_add; 3.6 has only its builder op.
_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_from_builder


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, START,
              END, ORDER, q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h, H,
              N, window, t0, t_end, t_step, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr,
              GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              Q_BUFFERS: gl.constexpr, ORDERED: gl.constexpr):
    """For each work item of the program: each consumer's query rows, then the key and value tiles they stream.
    The ring of slots runs on across items, so the next item's loads start while the consumers finish the last."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    ring = t0 * 0  # tiles streamed by the items before
    item = t0 * 0
    for t in range(t0, t_end, t_step):
        b, h, m0 = _work_item(t, t_end, t_step, ORDER, H, N, ROWS, CAUSAL, ORDERED)
        _, _, first, n_tiles = _key_stream(b, m0, N, window, START, END, ROWS, CAUSAL, WINDOW, DOCS, BLOCK_N)
        kv_h = h // GROUP
        buf = item % Q_BUFFERS
        # A fresh barrier counts as having completed the phase before its first: the first pass does not wait.
        mbarrier.wait(q_empty.index(buf), ((item // Q_BUFFERS) & 1) ^ 1)
        mbarrier.expect(q_ready.index(buf), NUM_CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            _tma_load(q_desc, [b * q_rows_b + h * q_rows_h + m0 + c * BLOCK_M, h * q_cols_h], q_ready.index(buf),
                      q_smem.index(buf * NUM_CONSUMERS + c))
        k_row = b * k_rows_b + kv_h * k_rows_h + first * BLOCK_N
        v_row = b * v_rows_b + kv_h * v_rows_h + first * BLOCK_N
        for j in range(n_tiles):
            i = ring + j
            slot = i % STAGES
            mbarrier.wait(kv_empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + j * BLOCK_N, kv_h * k_cols_h], k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row + j * BLOCK_N, kv_h * v_cols_h], v_ready.index(slot), v_smem.index(slot))
        ring += n_tiles
        item += 1


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, EMPTY_ROWS: gl.constexpr = False):
    """p = exp2(qk_scale s - m) at the new running max m; alpha rescales what was summed at the old one.

    EMPTY_ROWS: a row may have seen no key yet (a window or documents masked all it has seen); its max stays -inf
    and it is shifted by 0, so that its p and alpha are 0, not NaN."""
    # qk_scale > 0, so max(s) * qk_scale == max(s * qk_scale), and the subtraction fuses into one FMA per score.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    shift = m_new
    if EMPTY_ROWS:
        shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - shift[:, None])
    alpha = gl.exp2(m_i - shift)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


# ----------------------------------------------------------------------------------------------------------
# Masks. Beyond causal, a window and documents (WINDOW, DOCS) decide which keys a query sees. Per block of rows,
# the tiles of the other side that some row needs are streamed, [lo, hi); those that every row sees whole,
# [full_lo, full_hi), run unmasked; only the tiles between are masked. START and END give each position's document
# bounds (int32 (batch, seq), attention.masks.doc_bounds), moved to the program's sequence.
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _tile_range(first, last, N, window, START, END, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                DOCS: gl.constexpr, ROWS_ARE_QUERIES: gl.constexpr, BLOCK: gl.constexpr):
    """(lo, full_lo, full_hi, hi) in tiles of BLOCK: for query rows first..last the key tiles they see, for key rows
    the query tiles that see them; [lo, hi) every tile some row needs, [full_lo, full_hi) the tiles every row sees
    whole (lo <= full_lo <= full_hi <= hi)."""
    lo = first * 0
    full_lo = first * 0
    hi = N + first * 0
    full_hi = N + first * 0
    if ROWS_ARE_QUERIES:
        if CAUSAL:
            hi = last + 1
            full_hi = first + 1
        if WINDOW:
            lo = gl.maximum(first - window + 1, 0)
            full_lo = gl.maximum(last - window + 1, 0)
            if not CAUSAL:
                hi = gl.minimum(hi, last + window)
                full_hi = gl.minimum(full_hi, first + window)
    else:
        if CAUSAL:
            lo = first
            full_lo = last
        if WINDOW:
            hi = gl.minimum(hi, last + window)
            full_hi = gl.minimum(full_hi, first + window)
            if not CAUSAL:
                lo = gl.maximum(first - window + 1, 0)
                full_lo = gl.maximum(last - window + 1, 0)
    if DOCS:  # documents are runs of positions: the rows see the other side from first's document to last's
        lo = gl.maximum(lo, gl.load(START + first))
        hi = gl.minimum(hi, gl.load(END + last))
        full_lo = gl.maximum(full_lo, gl.load(START + last))
        full_hi = gl.minimum(full_hi, gl.load(END + first))
    lo = lo // BLOCK
    hi = gl.cdiv(hi, BLOCK)
    full_lo = gl.minimum(gl.maximum(gl.cdiv(full_lo, BLOCK), lo), hi)
    full_hi = gl.maximum(gl.minimum(full_hi // BLOCK, hi), full_lo)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _keep(q_idx, k_idx, other, doc_lo, doc_hi, window, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
          DOCS: gl.constexpr):
    """Whether query q_idx sees key k_idx (broadcast shapes). Documents are runs of positions, so two positions
    share one when `other` (the streamed side's position) lies in [doc_lo, doc_hi), the bounds of the resident row's
    document: two comparisons, no load per tile."""
    diff = q_idx - k_idx
    if DOCS:
        same_doc = (other >= doc_lo) & (other < doc_hi)
    if WINDOW:
        if CAUSAL:
            keep = (diff >= 0) & (diff < window)
        else:
            keep = (diff < window) & (diff > -window)
    elif CAUSAL:
        keep = diff >= 0
    else:
        keep = same_doc  # documents alone
    if DOCS and (WINDOW or CAUSAL):
        keep = keep & same_doc
    return keep


@gluon.jit
def _doc_bounds(START, END, idx, DOCS: gl.constexpr):
    """[start, end) of each idx's document (idx, idx without documents, where they are never read)."""
    if DOCS:
        return gl.load(START + idx), gl.load(END + idx)
    return idx, idx


@gluon.jit
def _row_mask(s, rows, row_start, row_end, k0, window, other: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """s (query rows x keys k0 ..) with the scores the rows do not see set to `other`; [row_start, row_end): each
    row's document."""
    cols = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = _keep(rows[:, None], cols[None, :], cols[None, :], row_start[:, None], row_end[:, None], window, CAUSAL,
                 WINDOW, DOCS)
    return gl.where(keep, s, other)


@gluon.jit
def _key_mask(pt, keys, key_start, key_end, q0, window, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              DOCS: gl.constexpr, BLOCK_N: gl.constexpr, st_layout: gl.constexpr):
    """pt (key rows x queries q0 ..) with the entries of keys the queries do not see set to 0; [key_start,
    key_end): each key's document."""
    cols = q0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st_layout))
    keep = _keep(cols[None, :], keys[:, None], cols[None, :], key_start[:, None], key_end[:, None], window, CAUSAL,
                 WINDOW, DOCS)
    return gl.where(keep, pt, 0.0)


@gluon.jit
def _key_tile(j, ring, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows, row_start, row_end,
              first, window, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Streamed tile j's (key tile first + j, in ring slot ring + j) scores and softmax, overlapped with tile j-1's
    P V; returns the state after both."""
    slot = (ring + j) % STAGES
    prev = (ring + j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), ((ring + j) // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((ring + j - 1) // STAGES) & 1)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    # wgmma groups retire in order: with one left in flight, the score matmul is done and P V may still run.
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    if MASK:
        s = _row_mask(s, rows, row_start, row_end, (first + j) * BLOCK_N, window, float("-inf"), CAUSAL, WINDOW,
                      DOCS, BLOCK_N, s_layout)
    p32, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, MASK and (WINDOW or DOCS))
    # p is in the deps so that its registers stay reserved until the matmul reading them has retired.
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    mbarrier.arrive(kv_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p = gl.convert_layout(p32.to(q.dtype), p_layout)
    return acc, p, m_i, l_i


@gluon.jit
def _attend(o_desc, L, q, k_smem, v_smem, k_ready, v_ready, kv_empty, q_row, q_col, first_row, lse_row,
            lo, full_lo, full_hi, hi, first, ring, START, END, window, qk_scale, CAUSAL: gl.constexpr,
            WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """Attention of one consumer's BLOCK_M query rows over streamed key tiles [lo, hi) (key tiles first + lo ..,
    ring slots ring + lo ..), masked outside [full_lo, full_hi), written out."""
    dtype: gl.constexpr = o_desc.dtype
    D: gl.constexpr = o_desc.block_type.shape[1]
    VARIANT: gl.constexpr = WINDOW or DOCS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    # P goes to the P V matmul from registers: the score accumulator's layout already is the operand's.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = first_row + gl.arange(0, BLOCK_M, layout=row_s)  # query positions in the sequence
    row_start, row_end = _doc_bounds(START, END, rows, DOCS)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    # Tile lo: scores and softmax only; its P V is issued beside the next tile's scores (or after the loops).
    mbarrier.wait(k_ready.index((ring + lo) % STAGES), ((ring + lo) // STAGES) & 1)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index((ring + lo) % STAGES).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    if CAUSAL or VARIANT:
        if (lo < full_lo) | (lo >= full_hi):
            s = _row_mask(s, rows, row_start, row_end, (first + lo) * BLOCK_N, window, float("-inf"), CAUSAL,
                          WINDOW, DOCS, BLOCK_N, s_layout)
    p32, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale, VARIANT)
    p = gl.convert_layout(p32.to(dtype), p_layout)

    if VARIANT:  # tiles before the whole ones (the window's far edge, the document's start)
        for j in range(lo + 1, full_lo):
            acc, p, m_i, l_i = _key_tile(j, ring, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows,
                                         row_start, row_end, first, window, qk_scale, True, CAUSAL, WINDOW, DOCS,
                                         BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
    for j in range(gl.maximum(full_lo, lo + 1), full_hi):
        acc, p, m_i, l_i = _key_tile(j, ring, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows,
                                     row_start, row_end, first, window, qk_scale, False, CAUSAL, WINDOW, DOCS,
                                     BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
    if CAUSAL or VARIANT:  # the diagonal band, and tiles past the whole ones
        for j in range(gl.maximum(full_hi, lo + 1), hi):
            acc, p, m_i, l_i = _key_tile(j, ring, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows,
                                         row_start, row_end, first, window, qk_scale, True, CAUSAL, WINDOW, DOCS,
                                         BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, p_layout)

    last = ring + hi - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc_tok = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    mbarrier.arrive(kv_empty.index(last % STAGES), count=1)

    # Every row saw at least one key (causal row r sees key r; windows and documents include the row itself), so
    # l_i > 0.
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # This consumer's rows of Q are dead (its last score matmul retired): they hold O on its way out.
    q.store(o.to(dtype))
    fence_async_shared()
    _tma_store(o_desc, [q_row, q_col], q)
    lse = (m_i + gl.log2(l_i)) * LN2  # log2 -> natural log
    gl.store(L + lse_row + gl.arange(0, BLOCK_M, layout=row_s), lse)
    tma.store_wait(pendings=0)


@gluon.jit
def _release(ready, empty, lo, hi, STAGES: gl.constexpr, also_ready=None):
    """Give back streamed tiles [lo, hi) this consumer does not use, once loaded (with also_ready: by both
    barriers)."""
    for i in range(lo, hi):
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
        if also_ready is not None:
            mbarrier.wait(also_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(i % STAGES), count=1)


@gluon.jit
def _consumer(o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
              q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, CONSUMER: gl.constexpr,
              CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
              ORDERED: gl.constexpr):
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS
    ring = t0 * 0
    item = t0 * 0
    for t in range(t0, t_end, t_step):
        b, h, m0 = _work_item(t, t_end, t_step, ORDER, H, N, ROWS, CAUSAL, ORDERED)
        starts, ends, first, n_tiles = _key_stream(b, m0, N, window, START, END, ROWS, CAUSAL, WINDOW, DOCS, BLOCK_N)
        first_row = m0 + CONSUMER * BLOCK_M
        buf = item % Q_BUFFERS
        mbarrier.wait(q_ready.index(buf), (item // Q_BUFFERS) & 1)
        # Streamed tiles before and after this consumer's own (causal, windows, documents) are still loaded for the
        # others: released once loaded, so an arrival never counts toward a slot's previous use.
        if first_row < N:  # the last item's last consumers may have no rows (N % BLOCK_M == 0)
            lo, full_lo, full_hi, hi = _tile_range(first_row, first_row + BLOCK_M - 1, N, window, starts, ends,
                                                   CAUSAL, WINDOW, DOCS, True, BLOCK_N)
            _release(k_ready, kv_empty, ring, ring + lo - first, STAGES, v_ready)
            _attend(o_desc, L, q_smem.index(buf * NUM_CONSUMERS + CONSUMER), k_smem, v_smem, k_ready, v_ready,
                    kv_empty, b * q_rows_b + h * q_rows_h + first_row, h * q_cols_h, first_row,
                    (b * H + h) * N + first_row, lo - first, full_lo - first, full_hi - first, hi - first, first,
                    ring, starts, ends, window, qk_scale, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)
            n_done = hi - first
        else:
            n_done = first * 0
        _release(k_ready, kv_empty, ring + n_done, ring + n_tiles, STAGES, v_ready)
        mbarrier.arrive(q_empty.index(buf), count=1)  # O has left this consumer's rows of the buffer (_attend)
        ring += n_tiles
        item += 1


@gluon.jit
def _work_item(t, t_end, t_step, ORDER, H, N, ROWS: gl.constexpr, CAUSAL: gl.constexpr, ORDERED: gl.constexpr):
    """(b, h, first query row) of forward work item t: item t covers query rows block t % blocks of (batch, head)
    t // blocks, the blocks of a head in the order they launch (see _query_program).

    ORDERED (documents): ORDER lists the (batch, block) pairs by the key tiles they stream, most first
    (attention.flash.triton.host.work_order), and each pair stands for its H heads in turn. Program p takes the items
    of ranks p, 2 * programs - 1 - p, 2 * programs + p, ...: a snake through the ranks, so every program gets a long
    item and a short one in turn, where a round robin leaves some programs far busier than the mean (docs/flash.md,
    The order of the items with documents)."""
    blocks = gl.cdiv(N, ROWS)
    if ORDERED:
        k = t // t_step
        p = t % t_step
        rank = t
        if (k % 2 == 1) & ((k + 1) * t_step <= t_end):  # a full round runs backward; a last partial one forward
            rank = k * t_step + t_step - 1 - p
        bm = gl.load(ORDER + rank // H)
        return bm // blocks, rank % H, (bm % blocks) * ROWS
    m = t % blocks
    if CAUSAL:
        m = blocks - 1 - m  # the longest rows first, for a better tail
    bh = t // blocks
    return bh // H, bh % H, m * ROWS


@gluon.jit
def _query_program(H, N, ROWS: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, bh, first query row) of a program that owns ROWS query rows.

    The sequence is the grid's fastest axis: the programs running at once mostly share one head's keys and values
    in L2. Launching every head's longest programs first instead (the head index fastest) shortens the causal tail
    on paper, but the forward ran slower (docs/flash.md, Hopper tiles).
    """
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest rows first, for a better tail
    else:
        pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    return bh // H, bh % H, bh, pid_m * ROWS


@gluon.jit
def _key_stream(b, m0, N, window, START, END, ROWS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                DOCS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(START, END moved to sequence b, first key tile, key tiles) a program of query rows m0 .. m0 + ROWS - 1
    streams."""
    if DOCS:
        START += b * N
        END += b * N
    lo, _, _, hi = _tile_range(m0, gl.minimum(m0 + ROWS, N) - 1, N, window, START, END, CAUSAL, WINDOW, DOCS, True,
                               BLOCK_N)
    return START, END, lo, hi - lo


@gluon.jit
def attn_fwd_hopper(
    q_desc, k_desc, v_desc, o_desc, L, START, END, ORDER,
    q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    H, N, BH, window, qk_scale,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PERSISTENT: gl.constexpr = False,
):
    """O and L of BH (batch, head) pairs, in work items of NUM_CONSUMERS * BLOCK_M query rows of one pair;
    N % BLOCK_M == N % BLOCK_N == 0.

    A program runs one item (grid: items of a pair, pairs), or with PERSISTENT items pid, pid + programs, ...
    (grid: programs): its producer then loads the next item's query rows and first key tiles while the consumers
    finish the last, which pays where an item streams few key tiles (windows, documents).

    Q, K, V and O are 2-D descriptors over their storage: row b * rows_b + h * rows_h + position, column
    h * cols_h. That covers (batch, heads, seq, d) and (batch, seq, heads, d) memory alike. GROUP > 1 (GQA): query
    head h reads key/value head h // GROUP. WINDOW, DOCS: a window of `window` keys, documents bounded by START and
    END (see _tile_range).
    """
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = q_desc.block_type.shape[1]
    # Two buffers of query rows when items follow each other: the next item's rows load while O of the last leaves.
    Q_BUFFERS: gl.constexpr = 1 + PERSISTENT
    ORDERED: gl.constexpr = PERSISTENT and DOCS  # items in the order ORDER gives (_work_item)
    if PERSISTENT:
        t0 = gl.program_id(0)
        t_end = gl.cdiv(N, BLOCK_M * NUM_CONSUMERS) * BH
        t_step = gl.num_programs(0)
    else:
        t0 = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        t_end = t0 + 1
        t_step = 1

    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * NUM_CONSUMERS, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the initialised barriers, visible to the TMA unit

    # Worker partitions take no distributed tensors, so each consumer's arguments are spelled out.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, 0, CAUSAL,
                         WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
            (_consumer, (o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, 1, CAUSAL,
                         WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, START, END, ORDER, q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h,
                         v_rows_b, v_rows_h, v_cols_h, H, N, window, t0, t_end, t_step, CAUSAL, WINDOW, DOCS, GROUP,
                         BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.static_assert(NUM_CONSUMERS == 3, "2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, 0, CAUSAL,
                         WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
            (_consumer, (o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, 1, CAUSAL,
                         WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
            (_consumer, (o_desc, L, START, END, ORDER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, q_rows_b, q_rows_h, q_cols_h, H, N, window, qk_scale, t0, t_end, t_step, 2, CAUSAL,
                         WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                         kv_empty, START, END, ORDER, q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h,
                         v_rows_b, v_rows_h, v_cols_h, H, N, window, t0, t_end, t_step, CAUSAL, WINDOW, DOCS, GROUP,
                         BLOCK_N, STAGES, NUM_CONSUMERS, Q_BUFFERS, ORDERED)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


# ----------------------------------------------------------------------------------------------------------
# Backward: dQ (a program per NUM_CONSUMERS * BLOCK_M query rows, key tiles stream past) and dK/dV (a program per
# NUM_CONSUMERS * BLOCK_M key rows, query tiles stream past). delta = rowsum(dO * O) comes from flash's Triton
# pre-pass. Both stay deterministic: every output row is summed by one consumer, in one order.
#
# dQ: for key tile j a consumer issues S_j = Q K_j^T, dP_j = dO V_j^T and then dQ += dS_{j-1} K_{j-1}, and computes
# P_j and dS_j while those run. dK/dV: tile i's S^T_i = K Q_i^T is already done when the tile starts; the consumer
# issues dP^T_i = V dO_i^T and dK += dS^T_{i-1} Q_{i-1}, computes P^T_i, issues dV += P^T_i dO_i, computes dS^T_i,
# and issues S^T_{i+1} before it waits for the rest. Both wait for their last matmul at the end of the tile (see
# _dkdv_query_tile).
# ----------------------------------------------------------------------------------------------------------

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _bwd_producer(r0_desc, r1_desc, t0_desc, t1_desc, r0_smem, r1_smem, t0_smem, t1_smem, res_ready, ready, empty,
                  r0_row, r0_col, r1_row, r1_col, t0_row, t0_col, t1_row, t1_col, first, n_tiles,
                  STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                  lse_desc=None, delta_desc=None, lse_smem=None, delta_smem=None, stats_base=0,
                  GROUP: gl.constexpr = 1, t0_head_rows=0, t0_head_col=0, t1_head_rows=0, t1_head_col=0, N=0):
    """Each consumer's two resident tiles, then streamed tiles first .. first + n_tiles - 1 of two tensors, and with
    lse_desc (dK/dV) the same tiles' L and delta, flat (batch * heads * seq) vectors from stats_base on.

    GROUP > 1 (dK/dV of GQA): n_tiles covers GROUP heads in turn, each n_tiles / GROUP tiles from `first`; head g's
    tiles sit g * t*_head_rows rows and g * t*_head_col columns further, its L and delta g * N further."""
    R: gl.constexpr = r0_desc.block_type.shape[0]
    T: gl.constexpr = t0_desc.block_type.shape[0]
    STATS: gl.constexpr = lse_desc is not None
    mbarrier.expect(res_ready, NUM_CONSUMERS * (r0_desc.block_type.nbytes + r1_desc.block_type.nbytes))
    for c in gl.static_range(NUM_CONSUMERS):
        _tma_load(r0_desc, [r0_row + c * R, r0_col], res_ready, r0_smem.index(c))
        _tma_load(r1_desc, [r1_row + c * R, r1_col], res_ready, r1_smem.index(c))
    tile_bytes: gl.constexpr = t0_desc.block_type.nbytes + t1_desc.block_type.nbytes
    per_head = n_tiles // GROUP
    for i in range(n_tiles):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes the first wait
        row = (first + i) * T
        r0, c0, r1, c1, stats = t0_row, t0_col, t1_row, t1_col, stats_base
        if GROUP > 1:
            g = i // per_head
            row = (first + i - g * per_head) * T
            r0, c0 = t0_row + g * t0_head_rows, t0_col + g * t0_head_col
            r1, c1 = t1_row + g * t1_head_rows, t1_col + g * t1_head_col
            stats = stats_base + g * N
        if STATS:
            mbarrier.expect(ready.index(slot), tile_bytes + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            _tma_load(lse_desc, [stats + row], ready.index(slot), lse_smem.index(slot))
            _tma_load(delta_desc, [stats + row], ready.index(slot), delta_smem.index(slot))
        else:
            mbarrier.expect(ready.index(slot), tile_bytes)
        _tma_load(t0_desc, [r0 + row, c0], ready.index(slot), t0_smem.index(slot))
        _tma_load(t1_desc, [r1 + row, c1], ready.index(slot), t1_smem.index(slot))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """(resident tiles loaded, slot loaded, slot free) mbarriers of a backward kernel, initialised."""
    res_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(res_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the initialised barriers, visible to the TMA unit
    return res_ready, ready, empty


@gluon.jit
def _dq_key_tile(i, q, do, k_smem, v_smem, ready, empty, dq, ds, lse2, delta, rows, row_start, row_end, first, window,
                 qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                 ds_layout: gl.constexpr):
    """Streamed tile i's (key tile first + i) dS, computed while tile i-1's dQ += dS K runs; returns dQ through tile
    i-1 and tile i's dS."""
    slot = i % STAGES
    prev = (i - 1) % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(slot).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds, k_smem.index(prev), dq, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=2, deps=[s_tok])
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if MASK:
        p = _row_mask(p, rows, row_start, row_end, (first + i) * BLOCK_N, window, 0.0, CAUSAL, WINDOW, DOCS,
                      BLOCK_N, s_layout)
    dp = warpgroup_mma_wait(num_outstanding=1, deps=[dp_tok])
    ds32 = p * (dp - delta[:, None])
    dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok, ds])
    mbarrier.arrive(empty.index(prev), count=1)
    return dq, gl.convert_layout(ds32.to(k_smem.dtype), ds_layout)


@gluon.jit
def _dq_rows(dq_desc, L, DELTA, q, do, k_smem, v_smem, ready, empty, q_row, q_col, first_row, lse_row,
             lo, full_lo, full_hi, hi, first, START, END, window, qk_scale, scale, CAUSAL: gl.constexpr,
             WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr):
    """dQ of one consumer's BLOCK_M query rows over streamed key tiles [lo, hi), masked outside [full_lo, full_hi),
    written out."""
    dtype: gl.constexpr = dq_desc.dtype
    D: gl.constexpr = dq_desc.block_type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    VARIANT: gl.constexpr = WINDOW or DOCS

    rows = first_row + gl.arange(0, BLOCK_M, layout=row_s)
    row_start, row_end = _doc_bounds(START, END, rows, DOCS)
    lse2 = gl.load(L + lse_row + gl.arange(0, BLOCK_M, layout=row_s)) * LOG2E
    delta = gl.load(DELTA + lse_row + gl.arange(0, BLOCK_M, layout=row_s))
    dq = gl.zeros([BLOCK_M, D], gl.float32, dq_layout)

    # Tile lo: its dS only; its dQ matmul is issued beside the next tile's score matmuls (or after the loops).
    slot = lo % STAGES
    mbarrier.wait(ready.index(slot), (lo // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(slot).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if CAUSAL or VARIANT:
        if (lo < full_lo) | (lo >= full_hi):
            p = _row_mask(p, rows, row_start, row_end, (first + lo) * BLOCK_N, window, 0.0, CAUSAL, WINDOW,
                          DOCS, BLOCK_N, s_layout)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])
    ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)

    if VARIANT:  # tiles before the whole ones
        for i in range(lo + 1, full_lo):
            dq, ds = _dq_key_tile(i, q, do, k_smem, v_smem, ready, empty, dq, ds, lse2, delta, rows, row_start, row_end,
                                  first, window, qk_scale, True, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES,
                                  s_layout, ds_layout)
    for i in range(gl.maximum(full_lo, lo + 1), full_hi):
        dq, ds = _dq_key_tile(i, q, do, k_smem, v_smem, ready, empty, dq, ds, lse2, delta, rows, row_start, row_end,
                              first, window, qk_scale, False, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES,
                              s_layout, ds_layout)
    if CAUSAL or VARIANT:  # the diagonal band, and tiles past the whole ones
        for i in range(gl.maximum(full_hi, lo + 1), hi):
            dq, ds = _dq_key_tile(i, q, do, k_smem, v_smem, ready, empty, dq, ds, lse2, delta, rows, row_start, row_end,
                                  first, window, qk_scale, True, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES,
                                  s_layout, ds_layout)

    last = hi - 1
    dq_tok = warpgroup_mma(ds, k_smem.index(last % STAGES), dq, is_async=True)
    dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok, ds])
    mbarrier.arrive(empty.index(last % STAGES), count=1)

    # dS was taken w.r.t. the scaled scores. This consumer's Q rows are dead: they hold dQ on its way out.
    q.store((dq * scale).to(dtype))
    fence_async_shared()
    _tma_store(dq_desc, [q_row, q_col], q)
    tma.store_wait(pendings=0)


@gluon.jit
def _dq_consumer(dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty, q_row,
                 q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, CONSUMER: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    first_row = m0 + CONSUMER * BLOCK_M
    mbarrier.wait(res_ready, 0)
    if first_row < N:
        lo, full_lo, full_hi, hi = _tile_range(first_row, first_row + BLOCK_M - 1, N, window, START, END, CAUSAL,
                                               WINDOW, DOCS, True, BLOCK_N)
        _release(ready, empty, 0, lo - first, STAGES)
        _dq_rows(dq_desc, L, DELTA, q_smem.index(CONSUMER), do_smem.index(CONSUMER), k_smem, v_smem, ready, empty,
                 q_row + CONSUMER * BLOCK_M, q_col, first_row, lse_base + CONSUMER * BLOCK_M, lo - first,
                 full_lo - first, full_hi - first, hi - first, first, START, END, window, qk_scale, scale, CAUSAL,
                 WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)
        n_done = hi - first
    else:
        n_done = first * 0
    _release(ready, empty, n_done, n_tiles, STAGES)


@gluon.jit
def attn_bwd_dq_hopper(
    q_desc, k_desc, v_desc, do_desc, dq_desc, L, DELTA, START, END,
    q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    do_rows_b, do_rows_h, do_cols_h,
    H, N, window, qk_scale, scale,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """dQ for NUM_CONSUMERS * BLOCK_M query rows of one (batch, head); descriptors, GROUP and the variants as in
    attn_fwd_hopper.

    dQ is written through dq_desc, which indexes like q_desc.
    """
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = q_desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS

    b, h, bh, m0 = _query_program(H, N, ROWS, CAUSAL)
    START, END, first, n_tiles = _key_stream(b, m0, N, window, START, END, ROWS, CAUSAL, WINDOW, DOCS, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    res_ready, ready, empty = _ring_barriers(STAGES, NUM_CONSUMERS)

    q_row = b * q_rows_b + h * q_rows_h + m0
    q_col = h * q_cols_h
    do_row = b * do_rows_b + h * do_rows_h + m0
    lse_base = bh * N + m0
    kv_h = h // GROUP
    k_row = b * k_rows_b + kv_h * k_rows_h
    v_row = b * v_rows_b + kv_h * v_rows_h
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                            q_row, q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, 0, CAUSAL,
                            WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)),
            (_dq_consumer, (dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                            q_row, q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, 1, CAUSAL,
                            WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                             q_row, q_col, do_row, h * do_cols_h, k_row, kv_h * k_cols_h, v_row, kv_h * v_cols_h,
                             first, n_tiles, STAGES, NUM_CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.static_assert(NUM_CONSUMERS == 3, "2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                            q_row, q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, 0, CAUSAL,
                            WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)),
            (_dq_consumer, (dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                            q_row, q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, 1, CAUSAL,
                            WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)),
            (_dq_consumer, (dq_desc, L, DELTA, START, END, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                            q_row, q_col, m0, lse_base, N, first, n_tiles, window, qk_scale, scale, 2, CAUSAL,
                            WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, res_ready, ready, empty,
                             q_row, q_col, do_row, h * do_cols_h, k_row, kv_h * k_cols_h, v_row, kv_h * v_cols_h,
                             first, n_tiles, STAGES, NUM_CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


@gluon.jit
def _dkdv_query_tile(i, st, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk, dv, ds, keys, key_start,
                     key_end, first, full_lo, full_hi, per_head, window, qk_scale, shared_ds, CAUSAL: gl.constexpr,
                     WINDOW: gl.constexpr, DOCS: gl.constexpr, NEXT: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, st_layout: gl.constexpr, op_layout: gl.constexpr,
                     GROUP: gl.constexpr, FUSED: gl.constexpr):
    """Query tile i's dV and transposed dS, while tile i-1's dK += dS^T Q runs.

    st is tile i's S^T = K Q_i^T, computed during the tile before. With NEXT, tile i+1's S^T is issued before this
    tile waits for its dK and dV matmuls, so the next tile starts on the exponentials at once: faster with a causal
    mask, the same without one given four slots (docs/flash.md, Hopper tiles). Returns
    dK through tile i-1, dV through tile i, dS^T of tile i and, with NEXT, tile i+1's S^T.
    """
    dtype: gl.constexpr = q_smem.dtype
    col_s: gl.constexpr = gl.SliceLayout(0, st_layout)
    slot = i % STAGES
    prev = (i - 1) % STAGES
    dpt_tok = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)),
                            gl.zeros([BLOCK_M, BLOCK_N], gl.float32, st_layout), use_acc=False, is_async=True)
    dk_tok = warpgroup_mma(ds, q_smem.index(prev), dk, is_async=True)
    # The tile's row statistics came with it (the producer's TMA): a shared-memory read, while the matmuls run.
    lse2 = lse_smem.index(slot).load(col_s) * LOG2E
    delta = delta_smem.index(slot).load(col_s)
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if CAUSAL or WINDOW or DOCS:
        j = i  # the tile's place in its head's stream (GQA streams the group's heads in turn)
        if GROUP > 1:
            j = i % per_head
        # One loop for the masked tiles and the rest: one copy of the tile's code, a branch per tile.
        if (j < full_lo) | (j >= full_hi):
            pt = _key_mask(pt, keys, key_start, key_end, (first + j) * BLOCK_N, window, CAUSAL, WINDOW, DOCS,
                           BLOCK_N, st_layout)
    pt_op = gl.convert_layout(pt.to(dtype), op_layout)
    dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=2, deps=[dpt_tok])  # dK of tile i-1 and dV of tile i may still run
    dst = pt * (dpt - delta[None, :])
    if FUSED:
        _share_ds(shared_ds, i, dst.to(dtype))
    if NEXT and STAGES > 2:
        nxt = (i + 1) % STAGES
        mbarrier.wait(ready.index(nxt), ((i + 1) // STAGES) & 1)
        st_tok = warpgroup_mma(k, q_smem.index(nxt).permute((1, 0)),
                               gl.zeros([BLOCK_M, BLOCK_N], gl.float32, st_layout), use_acc=False, is_async=True)
        # All three are waited for: an accumulator still in flight across the loop's back edge makes ptxas serialise
        # every wgmma of the kernel (C7514, "non wgmma instructions reading accumulator registers").
        dk, dv, ds, pt_op, st = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok, dv_tok, ds, pt_op, st_tok])
        mbarrier.arrive(empty.index(prev), count=1)  # Q, dO, L and delta of tile i-1 are read
    else:
        dk, dv, ds, pt_op = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok, dv_tok, ds, pt_op])
        mbarrier.arrive(empty.index(prev), count=1)
        if NEXT:  # two slots: tile i+1 loads into tile i-1's slot, free only now (waiting first would deadlock)
            st = _next_scores(k, q_smem, ready, i + 1, BLOCK_M, BLOCK_N, STAGES, st_layout)
    return dk, dv, gl.convert_layout(dst.to(dtype), op_layout), st


@gluon.jit
def _dkdv_split_tile(i, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk, dv, keys, query_tile,
                     shared_ds, qk_scale, CAUSAL: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, st_layout: gl.constexpr, op_layout: gl.constexpr):
    """Query tile i of the fused backward whose consumers split d: dV, dK and this consumer's share of dQ.

    S^T and dP^T first; once dS^T is in shared memory for the other consumer, dV, the dQ share (both consumers' dS
    times this consumer's columns of their K rows) and dK run in that order, and the share is staged for _dq_writer
    while dK runs. Nothing stays in flight past the tile (FlashAttention-3's order). Returns dK and dV through tile
    i."""
    dtype: gl.constexpr = q_smem.dtype
    col_s: gl.constexpr = gl.SliceLayout(0, st_layout)
    slot = i % STAGES
    st_tok, dpt_tok = _issue_scores(k, v, q_smem, do_smem, ready, i, BLOCK_M, BLOCK_N, STAGES, st_layout)
    lse2 = lse_smem.index(slot).load(col_s) * LOG2E
    st = warpgroup_mma_wait(num_outstanding=1, deps=[st_tok])
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if MASKED:  # the diagonal's tiles; query_tile: the tile's place in its head's sequence
        pt = _key_mask(pt, keys, keys, keys, query_tile * BLOCK_N, 0, CAUSAL, False, False, BLOCK_N, st_layout)
    delta = delta_smem.index(slot).load(col_s)
    dpt = warpgroup_mma_wait(num_outstanding=0, deps=[dpt_tok])
    dst = (pt * (dpt - delta[None, :])).to(dtype)
    pt_op = gl.convert_layout(pt.to(dtype), op_layout)
    _share_ds(shared_ds, i, dst)
    dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
    dq = _issue_dq_share(shared_ds, i)
    ds = gl.convert_layout(dst, op_layout)
    dk_tok = warpgroup_mma(ds, q_smem.index(slot), dk, is_async=True)
    dv, pt_op, dq = warpgroup_mma_wait(num_outstanding=1, deps=[dv_tok, pt_op, dq])
    _stage_dq_share(shared_ds, i, dq)
    dk, ds = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok, ds])
    mbarrier.arrive(empty.index(slot), count=1)  # Q, dO, L and delta of tile i are read
    return dk, dv


@gluon.jit
def _issue_scores(k, v, q_smem, do_smem, ready, i, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, layout: gl.constexpr):
    """S^T = K Q_i^T and dP^T = V dO_i^T of streamed tile i, issued once the tile is loaded."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    st_tok = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout),
                           use_acc=False, is_async=True)
    dpt_tok = warpgroup_mma(v, do_smem.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout),
                            use_acc=False, is_async=True)
    return st_tok, dpt_tok


@gluon.jit
def _next_scores(a, b_smem, ready, i, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 layout: gl.constexpr):
    """a b_i^T for streamed tile i, once loaded, waited for."""
    mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
    return warpgroup_mma(a, b_smem.index(i % STAGES).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout),
                         use_acc=False)


@gluon.jit
def _dkdv_rows(dk_desc, dv_desc, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk_row, dk_col, dv_row,
               dv_col, first_key, first, full_lo, full_hi, lo, hi, n_tiles, START, END, window, qk_scale, scale,
               shared_ds, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, FUSED: gl.constexpr):
    """dK and dV of one consumer's BLOCK_M key rows over streamed query tiles [lo, hi) (of GROUP query heads in
    turn, n_tiles in all; query tiles first + j of each), written out. Tiles outside [full_lo, full_hi) of a head's
    stream are masked; where [lo, hi) is the whole stream (_dkdv_consumer), those that lie wholly outside this
    consumer's keys are masked to zero."""
    dtype: gl.constexpr = dk_desc.dtype
    D: gl.constexpr = dk_desc.block_type.shape[1]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, st_layout)

    keys = first_key + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    key_start, key_end = _doc_bounds(START, END, keys, DOCS)
    last = hi - 1
    per_head = n_tiles // GROUP
    dk = gl.zeros([BLOCK_M, D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_M, D], gl.float32, acc_layout)

    SPLIT: gl.constexpr = FUSED and shared_ds[5] is not None
    # The whole stream (no window or documents), each head's masked tiles in loops of their own: a branch per tile
    # in one loop made the fused kernel about 10% slower at B2 H16 N8192 d 128 causal.
    if SPLIT:
        for g in range(GROUP):
            h0 = g * per_head
            for i in range(h0, h0 + full_lo):
                dk, dv = _dkdv_split_tile(i, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk, dv, keys,
                                          first + i - h0, shared_ds, qk_scale, CAUSAL, CAUSAL, BLOCK_M,
                                          BLOCK_N, STAGES, st_layout, op_layout)
            for i in range(h0 + full_lo, h0 + full_hi):
                dk, dv = _dkdv_split_tile(i, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk, dv, keys,
                                          first + i - h0, shared_ds, qk_scale, CAUSAL, False, BLOCK_M,
                                          BLOCK_N, STAGES, st_layout, op_layout)
            for i in range(h0 + full_hi, h0 + per_head):
                dk, dv = _dkdv_split_tile(i, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk, dv, keys,
                                          first + i - h0, shared_ds, qk_scale, CAUSAL, CAUSAL, BLOCK_M,
                                          BLOCK_N, STAGES, st_layout, op_layout)
    else:
        # Tile lo: dV and dS^T only; its dK matmul is issued beside the next tile's dP^T (or after the loop).
        slot = lo % STAGES
        st_tok, dpt_tok = _issue_scores(k, v, q_smem, do_smem, ready, lo, BLOCK_M, BLOCK_N, STAGES, st_layout)
        lse2 = lse_smem.index(slot).load(col_s) * LOG2E
        delta = delta_smem.index(slot).load(col_s)
        st = warpgroup_mma_wait(num_outstanding=1, deps=[st_tok])
        pt = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL or WINDOW or DOCS:
            pt = _key_mask(pt, keys, key_start, key_end, (first + lo) * BLOCK_N, window, CAUSAL, WINDOW, DOCS, BLOCK_N,
                           st_layout)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt_tok])
        dst = pt * (dpt - delta[None, :])
        if FUSED:
            _share_ds(shared_ds, lo, dst.to(dtype))
        dv, pt_op = warpgroup_mma_wait(num_outstanding=0, deps=[dv_tok, pt_op])
        ds = gl.convert_layout(dst.to(dtype), op_layout)

        if last > lo:
            st = _next_scores(k, q_smem, ready, lo + 1, BLOCK_M, BLOCK_N, STAGES, st_layout)
            for i in range(lo + 1, last):
                dk, dv, ds, st = _dkdv_query_tile(i, st, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk,
                                                  dv, ds, keys, key_start, key_end, first, full_lo, full_hi, per_head,
                                                  window, qk_scale, shared_ds, CAUSAL, WINDOW, DOCS, True, BLOCK_M,
                                                  BLOCK_N, STAGES, st_layout, op_layout, GROUP, FUSED)
            dk, dv, ds, st = _dkdv_query_tile(last, st, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, dk,
                                              dv, ds, keys, key_start, key_end, first, full_lo, full_hi, per_head,
                                              window, qk_scale, shared_ds, CAUSAL, WINDOW, DOCS, False, BLOCK_M,
                                              BLOCK_N, STAGES, st_layout, op_layout, GROUP,
                                              FUSED)  # the last: no S^T to issue

        dk_tok = warpgroup_mma(ds, q_smem.index(last % STAGES), dk, is_async=True)
        dk, ds = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok, ds])
        mbarrier.arrive(empty.index(last % STAGES), count=1)

    # This consumer's K and V rows are dead (their last matmuls retired): they hold dK and dV on their way out.
    if SPLIT:  # this consumer's dQ matmuls, which read every consumer's K rows, have retired
        _partition_barrier()
        mbarrier.arrive(shared_ds[4], count=1)
    if FUSED:  # once the last dQ matmul that reads K (the dQ warpgroup's, or every consumer's) has retired
        mbarrier.wait(shared_ds[4], 0)
    k.store((dk * scale).to(dtype))  # dS was taken w.r.t. the scaled scores
    v.store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [dk_row, dk_col], k)
    _tma_store(dv_desc, [dv_row, dv_col], v)
    tma.store_wait(pendings=0)


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, res_ready,
                   ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, n_tiles, window, qk_scale, scale,
                   ds_smem, ds_ready, ds_free, k_read, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, GROUP: gl.constexpr, FUSED: gl.constexpr = False, dq_share=None):
    first_key = n0 + CONSUMER * BLOCK_M
    if dq_share is not None:  # the consumers split d: this one's columns of every consumer's K rows
        k_all, dq_smem, dq_full, dq_empty = dq_share
        COLS: gl.constexpr = dq_smem.shape[2]
        k_share = (k_all.index(0).slice(CONSUMER * COLS, COLS, dim=1),
                   k_all.index(1).slice(CONSUMER * COLS, COLS, dim=1))  # FUSED: two consumers
        dq_share = (k_share, dq_smem, dq_full, dq_empty)
    shared_ds = (ds_smem, ds_ready, ds_free, CONSUMER, k_read, dq_share)
    mbarrier.wait(res_ready, 0)
    if (WINDOW or DOCS) and GROUP == 1:
        # The program streams the query tiles any of its keys needs: this consumer gives back unread those before
        # and after its own keys' range (with a window the last, with documents up to the rest of the stream).
        n_done = first * 0
        if first_key < N:
            lo, full_lo, full_hi, hi = _tile_range(first_key, first_key + BLOCK_M - 1, N, window, START, END,
                                                   CAUSAL, WINDOW, DOCS, False, BLOCK_N)
            _release(ready, empty, 0, lo - first, STAGES)
            _dkdv_rows(dk_desc, dv_desc, k_smem.index(CONSUMER), v_smem.index(CONSUMER), q_smem, do_smem, lse_smem,
                       delta_smem, ready, empty, dk_row + CONSUMER * BLOCK_M, dk_col, dv_row + CONSUMER * BLOCK_M,
                       dv_col, first_key, first, full_lo - first, full_hi - first, lo - first, hi - first, n_tiles,
                       START, END, window, qk_scale, scale, shared_ds, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES,
                       GROUP, False)
            n_done = hi - first
        _release(ready, empty, n_done, n_tiles, STAGES)
    elif first_key < N:
        # Causal alone skips at most one tile of a long stream, and these kernels keep constant bounds. With GQA the
        # stream repeats per query head, and a consumer goes through all of it.
        _, full_lo, full_hi, _ = _tile_range(first_key, first_key + BLOCK_M - 1, N, window, START, END, CAUSAL,
                                             WINDOW, DOCS, False, BLOCK_N)
        _dkdv_rows(dk_desc, dv_desc, k_smem.index(CONSUMER), v_smem.index(CONSUMER), q_smem, do_smem, lse_smem,
                   delta_smem, ready, empty, dk_row + CONSUMER * BLOCK_M, dk_col, dv_row + CONSUMER * BLOCK_M, dv_col,
                   first_key, first, full_lo - first, full_hi - first, 0, n_tiles, n_tiles, START, END, window,
                   qk_scale, scale, shared_ds, CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, GROUP, FUSED)
    else:
        _release(ready, empty, 0, n_tiles, STAGES)


@gluon.jit
def attn_bwd_dkdv_hopper(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_acc_desc, START, END,
    q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    do_rows_b, do_rows_h, do_cols_h,
    H, N, window, qk_scale, scale,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, DOCS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    FUSED: gl.constexpr = False, DS_LAYOUT: gl.constexpr = None, DQ_REGS: gl.constexpr = 0,
    SHARED_KV: gl.constexpr = 1,
):
    """dK and dV for NUM_CONSUMERS * BLOCK_M key rows of one (batch, key/value head), query tiles of BLOCK_N streamed.

    dK and dV are written through dk_desc and dv_desc, which index like k_desc and v_desc. lse_desc and delta_desc
    are 1-D descriptors over the flat (batch * heads * seq) L and delta, in blocks of BLOCK_N. H counts query heads;
    GROUP > 1 (GQA): the program streams the query tiles of its GROUP query heads one head after another, so its sum
    over them is one consumer's, in one order (deterministic, no atomics). The variants as in attn_fwd_hopper: the
    program streams the query tiles that see any of its keys.

    FUSED (two consumers, no window or documents): dQ too, each query tile's dQ = dS K over the program's keys added
    to the zeroed fp32 (batch * heads * seq, d) accumulator that dq_acc_desc describes, in blocks of all of d (by a
    warpgroup of its own, _dq_partition) or of each consumer's share of d (split, BLOCK_N 64: _dkdv_split_tile);
    DS_LAYOUT is the shared layout of a consumer's (BLOCK_M, BLOCK_N) dS^T. Otherwise dq_acc_desc is None.

    SHARED_KV > 1 (GROUP 1): a program per (batch, query head), whose SHARED_KV query heads share a key/value head:
    it reads K and V of head h // SHARED_KV and writes this query head's share of dK and dV through dk_desc and
    dv_desc, (batch * H * N, D) rows, for the host to sum over the group.
    """
    dtype: gl.constexpr = k_desc.dtype
    D: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS

    pid_n = gl.program_id(0)  # causal: the first key rows see the most queries, and launch first
    bh = gl.program_id(1)  # (batch, key/value head), or with SHARED_KV (batch, query head)
    b = bh // (H // GROUP)
    h = bh % (H // GROUP)  # the key/value head, or with SHARED_KV the query head
    hq = h * GROUP  # its first query head
    n0 = pid_n * ROWS
    gl.static_assert(SHARED_KV == 1 or GROUP == 1, "SHARED_KV: a program per query head")
    kv_h = h // SHARED_KV
    if DOCS:
        START += b * N
        END += b * N
    # Causal: queries above the program's first key see none of its keys.
    first, _, _, hi = _tile_range(n0, gl.minimum(n0 + ROWS, N) - 1, N, window, START, END, CAUSAL, WINDOW, DOCS,
                                  False, BLOCK_N)
    n_tiles = hi - first

    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], delta_desc.layout)
    res_ready, ready, empty = _ring_barriers(STAGES, NUM_CONSUMERS)

    k_row = b * k_rows_b + kv_h * k_rows_h + n0
    k_col = kv_h * k_cols_h
    v_row = b * v_rows_b + kv_h * v_rows_h + n0
    v_col = kv_h * v_cols_h
    if SHARED_KV > 1:  # this query head's share of dK and dV, in rows of its own
        dk_row = (b * H + h) * N + n0
        dk_col = 0
        dv_row = dk_row
        dv_col = 0
    else:
        dk_row, dk_col, dv_row, dv_col = k_row, k_col, v_row, v_col
    lse_base = (b * H + hq) * N
    q_row = b * q_rows_b + hq * q_rows_h
    do_row = b * do_rows_b + hq * do_rows_h
    if FUSED:
        gl.static_assert(NUM_CONSUMERS == 2 and not WINDOW and not DOCS, "FUSED: two consumers, no masks but causal")
        # Each dQ tile has D columns (the dQ warpgroup's) or, the consumers splitting d, each consumer's share.
        DQ_COLS: gl.constexpr = dq_acc_desc.block_type.shape[1]
        SPLIT: gl.constexpr = DQ_COLS < D
        # Two dS^T buffers (each both consumers' halves), so a tile's dQ matmul runs while the consumers compute the
        # next tile's dS^T.
        DS_BUFFERS: gl.constexpr = 2
        ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFFERS * NUM_CONSUMERS, BLOCK_M, BLOCK_N], DS_LAYOUT)
        ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFFERS, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [DS_BUFFERS, 1], mbarrier.MBarrierLayout())
        k_read = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        readers: gl.constexpr = NUM_CONSUMERS if SPLIT else 1  # who reads a dS^T buffer and every K row
        for i in gl.static_range(DS_BUFFERS):
            mbarrier.init(ds_ready.index(i), count=NUM_CONSUMERS)
            mbarrier.init(ds_free.index(i), count=readers)
        mbarrier.init(k_read, count=readers)
        fence_async_shared()
        dq_row = (b * H + hq) * N  # the accumulator's first row of the group's first query head
        if SPLIT:
            # One staging buffer per consumer, which _dq_writer adds to the accumulator.
            dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, BLOCK_N, DQ_COLS], dq_acc_desc.layout)
            dq_full = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
            dq_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
            for c in gl.static_range(NUM_CONSUMERS):
                mbarrier.init(dq_full.index(c), count=1)
                mbarrier.init(dq_empty.index(c), count=1)
            fence_async_shared()
            dq_share = (k_smem, dq_smem, dq_full, dq_empty)
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem,
                                  delta_smem, res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first,
                                  GROUP * n_tiles, window, qk_scale, scale, ds_smem, ds_ready, ds_free, k_read, 0,
                                  CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, GROUP, True, dq_share)),
                (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem,
                                  delta_smem, res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first,
                                  GROUP * n_tiles, window, qk_scale, scale, ds_smem, ds_ready, ds_free, k_read, 1,
                                  CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, GROUP, True, dq_share)),
                (_dq_writer, (dq_smem, dq_acc_desc, dq_full, dq_empty, dq_row, N, first, GROUP * n_tiles, GROUP,
                              NUM_CONSUMERS)),
                (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, res_ready, ready,
                                 empty, k_row, k_col, v_row, v_col, q_row, hq * q_cols_h, do_row, hq * do_cols_h,
                                 first, GROUP * n_tiles, STAGES, NUM_CONSUMERS, lse_desc, delta_desc, lse_smem,
                                 delta_smem, lse_base, GROUP, q_rows_h, q_cols_h, do_rows_h, do_cols_h, N)),
            ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, D], dq_acc_desc.layout)
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem,
                                  delta_smem, res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first,
                                  GROUP * n_tiles, window, qk_scale, scale, ds_smem, ds_ready, ds_free, k_read, 0,
                                  CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, GROUP, True)),
                (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem,
                                  delta_smem, res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first,
                                  GROUP * n_tiles, window, qk_scale, scale, ds_smem, ds_ready, ds_free, k_read, 1,
                                  CAUSAL, WINDOW, DOCS, BLOCK_M, BLOCK_N, STAGES, GROUP, True)),
                (_dq_partition, (k_smem, ds_smem, dq_smem, ds_ready, ds_free, k_read, res_ready, dq_acc_desc, dq_row,
                                 N, first, GROUP * n_tiles, BLOCK_N, GROUP, NUM_CONSUMERS)),
                (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, res_ready, ready,
                                 empty, k_row, k_col, v_row, v_col, q_row, hq * q_cols_h, do_row, hq * do_cols_h,
                                 first, GROUP * n_tiles, STAGES, NUM_CONSUMERS, lse_desc, delta_desc, lse_smem,
                                 delta_smem, lse_base, GROUP, q_rows_h, q_cols_h, do_rows_h, do_cols_h, N)),
            ], [4, 4, 1], [CONSUMER_REGS, DQ_REGS, 24])
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                              res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, GROUP * n_tiles,
                              window, qk_scale, scale, k_smem, ready, empty, res_ready, 0, CAUSAL, WINDOW, DOCS,
                              BLOCK_M, BLOCK_N, STAGES, GROUP)),
            (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                              res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, GROUP * n_tiles,
                              window, qk_scale, scale, k_smem, ready, empty, res_ready, 1, CAUSAL, WINDOW, DOCS,
                              BLOCK_M, BLOCK_N, STAGES, GROUP)),
            (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, res_ready, ready, empty,
                             k_row, k_col, v_row, v_col, q_row, hq * q_cols_h, do_row, hq * do_cols_h, first,
                             GROUP * n_tiles, STAGES, NUM_CONSUMERS, lse_desc, delta_desc, lse_smem, delta_smem,
                             lse_base, GROUP, q_rows_h, q_cols_h, do_rows_h, do_cols_h, N)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.static_assert(NUM_CONSUMERS == 3, "2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                              res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, GROUP * n_tiles,
                              window, qk_scale, scale, k_smem, ready, empty, res_ready, 0, CAUSAL, WINDOW, DOCS,
                              BLOCK_M, BLOCK_N, STAGES, GROUP)),
            (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                              res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, GROUP * n_tiles,
                              window, qk_scale, scale, k_smem, ready, empty, res_ready, 1, CAUSAL, WINDOW, DOCS,
                              BLOCK_M, BLOCK_N, STAGES, GROUP)),
            (_dkdv_consumer, (dk_desc, dv_desc, START, END, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                              res_ready, ready, empty, dk_row, dk_col, dv_row, dv_col, n0, N, first, GROUP * n_tiles,
                              window, qk_scale, scale, k_smem, ready, empty, res_ready, 2, CAUSAL, WINDOW, DOCS,
                              BLOCK_M, BLOCK_N, STAGES, GROUP)),
            (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, res_ready, ready, empty,
                             k_row, k_col, v_row, v_col, q_row, hq * q_cols_h, do_row, hq * do_cols_h, first,
                             GROUP * n_tiles, STAGES, NUM_CONSUMERS, lse_desc, delta_desc, lse_smem, delta_smem,
                             lse_base, GROUP, q_rows_h, q_cols_h, do_rows_h, do_cols_h, N)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


# ----------------------------------------------------------------------------------------------------------
# The fused backward (FUSED): the dK/dV program also computes dQ, five tile matmuls instead of the two kernels'
# seven. Each consumer puts its dS^T rows of a query tile in shared memory. At d 64 a warpgroup of their own then
# computes the tile's dQ = dS K over all the program's keys and adds it to an fp32 (batch * heads * seq, d)
# accumulator with one TMA reduction; the consumers keep their registers and their schedule. From d 128, where
# that warpgroup's registers would make the consumers spill, each consumer computes the dQ columns of its share of d
# itself and stages them in shared memory for a warp that adds them (_dq_writer). The sum's order varies from run
# to run.
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _share_ds(shared_ds, i, dst):
    """Puts streamed tile i's dS^T rows of this consumer where the dQ matmuls read them, once they are done with
    the buffer's tile before."""
    ds_smem, ds_ready, ds_free, consumer, _, _ = shared_ds
    BUFFERS: gl.constexpr = ds_ready.shape[0]
    buf = i % BUFFERS
    mbarrier.wait(ds_free.index(buf), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier passes the first wait
    ds_smem.index(buf * (ds_smem.shape[0] // BUFFERS) + consumer).store(dst)
    fence_async_shared()
    _partition_barrier()  # every warp's rows stored before the arrival
    mbarrier.arrive(ds_ready.index(buf), count=1)


@gluon.jit
def _issue_dq_share(shared_ds, i):
    """Issues streamed tile i's dQ columns of this consumer's share of d over all the program's keys (every
    consumer's dS times those columns of its K rows), once each consumer's dS^T of the tile is in shared memory."""
    ds_smem, ds_ready, _, _, _, dq_share = shared_ds
    k_share, dq_smem, _, _ = dq_share
    BLOCK_N: gl.constexpr = dq_smem.shape[1]
    COLS: gl.constexpr = dq_smem.shape[2]
    BUFFERS: gl.constexpr = ds_ready.shape[0]
    NUM_CONSUMERS: gl.constexpr = ds_smem.shape[0] // BUFFERS
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16])
    buf = i % BUFFERS
    mbarrier.wait(ds_ready.index(buf), (i // BUFFERS) & 1)
    dq = gl.zeros([BLOCK_N, COLS], gl.float32, layout)
    for c in gl.static_range(NUM_CONSUMERS):
        dq = warpgroup_mma(ds_smem.index(buf * NUM_CONSUMERS + c).permute((1, 0)), k_share[c], dq, is_async=True)
    return dq


@gluon.jit
def _stage_dq_share(shared_ds, i, dq):
    """Gives streamed tile i's dS^T buffer back and stages this consumer's retired dQ share of the tile for
    _dq_writer, once the writer's reduction of the tile before has read the staging buffer."""
    _, _, ds_free, consumer, _, dq_share = shared_ds
    _, dq_smem, dq_full, dq_empty = dq_share
    mbarrier.wait(dq_empty.index(consumer), (i & 1) ^ 1)  # a fresh barrier passes the first wait
    dq_smem.index(consumer).store(dq)
    fence_async_shared()
    _partition_barrier()  # every warp's share of the matmul retired and stored
    mbarrier.arrive(ds_free.index(i % ds_free.shape[0]), count=1)
    mbarrier.arrive(dq_full.index(consumer), count=1)


@gluon.jit
def _dq_writer(dq_smem, dq_acc_desc, dq_full, dq_empty, dq_row, N, first, n_tiles, GROUP: gl.constexpr,
               NUM_CONSUMERS: gl.constexpr):
    """Adds each consumer's staged dQ share of every streamed tile to the accumulator (rows dq_row + the tile's query
    head in the group * N + its queries, the share's columns of d) with one TMA reduction, and gives the staging
    buffer back once the reduction has read it: the consumers never wait on a reduction."""
    BLOCK_N: gl.constexpr = dq_smem.shape[1]
    COLS: gl.constexpr = dq_smem.shape[2]
    per_head = n_tiles // GROUP
    for i in range(n_tiles):
        g = i // per_head  # the stream takes the group's query heads in turn
        row = dq_row + g * N + (first + i - g * per_head) * BLOCK_N
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.wait(dq_full.index(c), i & 1)
            _tma_add(dq_acc_desc, [row, c * COLS], dq_smem.index(c))
        for c in gl.static_range(NUM_CONSUMERS):
            tma.store_wait(pendings=NUM_CONSUMERS - 1 - c)
            mbarrier.arrive(dq_empty.index(c), count=1)
    tma.store_wait(pendings=0)


@gluon.jit
def _dq_partition(k_smem, ds_smem, dq_smem, ds_ready, ds_free, k_read, res_ready, dq_acc_desc, dq_row, N, first,
                  n_tiles, BLOCK_N: gl.constexpr, GROUP: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """dQ of each streamed query tile over the program's keys, added to the accumulator: rows dq_row + (the tile's
    query head in the group) * N + its queries. Arrives on k_read once its last matmul has read K, which the
    consumers then overwrite with dK."""
    D: gl.constexpr = dq_acc_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    per_head = n_tiles // GROUP
    mbarrier.wait(res_ready, 0)  # K is resident
    for i in range(n_tiles):
        buf = i % 2
        mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
        dq = gl.zeros([BLOCK_N, D], gl.float32, layout)
        for c in gl.static_range(NUM_CONSUMERS):
            dq = warpgroup_mma(ds_smem.index(buf * NUM_CONSUMERS + c).permute((1, 0)), k_smem.index(c), dq,
                               is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
        _partition_barrier()  # every warp's share of the matmul retired before the buffer is given back
        mbarrier.arrive(ds_free.index(buf), count=1)
        g = i // per_head  # the stream takes the group's query heads in turn
        staged = dq_smem.index(buf)
        tma.store_wait(pendings=1)  # the reduction two tiles back has read this buffer
        _partition_barrier()
        staged.store(dq)
        fence_async_shared()
        _partition_barrier()
        _tma_add(dq_acc_desc, [dq_row + g * N + (first + i - g * per_head) * BLOCK_N, 0], staged)
    mbarrier.arrive(k_read, count=1)  # every matmul retired (waited in the loop, a partition barrier after)
    tma.store_wait(pendings=0)
