"""The Hopper (sm_90) forward kernel of `flash`, written in Gluon; the host code is in flash_hopper.py.

Triton 3.6 waits for a score matmul as soon as its result is read, so in flash's Triton kernels the softmax never
runs beside a matmul (see results/README.md, sixth session). Gluon states the schedule instead of leaving it to
the compiler. One program owns NUM_CONSUMERS * BLOCK_M query rows of one (batch, head):

- a producer warp streams key and value tiles into a ring of STAGES shared-memory slots with TMA;
- each consumer warpgroup owns BLOCK_M (64) query rows. For key tile j it issues the score matmul S_j = Q K_j^T
  and then the previous tile's O += P_{j-1} V_{j-1}, waits only for S_j, and computes the softmax of S_j while the
  P V matmul is still running on the tensor cores (FlashAttention-3's intra-warpgroup overlap). O is rescaled
  after that matmul retires: O then holds the sum up to tile j-1 at tile j's running max.

A slot is free again when every consumer has arrived on its `empty` barrier, which a consumer does once its P V
matmul of that tile has retired. Scores are in the base-2 domain (qk_scale = scale * log2 e) as in
flash_triton_kernels; L is the natural-log logsumexp that flash's backward reads.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
              q_row, q_col, k_row, k_col, v_row, v_col, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_ready, NUM_CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(NUM_CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row + c * BLOCK_M, q_col], q_ready, q_smem.index(c))
    for j in range(n_tiles):
        slot = j % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass does not wait.
        mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """p = exp2(qk_scale s - m) at the new running max m; alpha rescales what was summed at the old one."""
    # qk_scale > 0, so max(s) * qk_scale == max(s * qk_scale), and the subtraction fuses into one FMA per score.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _causal_mask(s, rows, j, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))


@gluon.jit
def _key_tile(j, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows, qk_scale,
              MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tile j's scores and softmax, overlapped with tile j-1's P V; returns the state after both."""
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    # wgmma groups retire in order: with one left in flight, the score matmul is done and P V may still run.
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    if MASK:
        s = _causal_mask(s, rows, j, BLOCK_N, s_layout)
    p32, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
    # p is in the deps so that its registers stay reserved until the matmul reading them has retired.
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    mbarrier.arrive(kv_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p = gl.convert_layout(p32.to(q.dtype), p_layout)
    return acc, p, m_i, l_i


@gluon.jit
def _attend(o_desc, L, q, k_smem, v_smem, k_ready, v_ready, kv_empty, q_row, q_col, first_row, lse_row, n_tiles,
            qk_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Attention of one consumer's BLOCK_M query rows, written out; returns how many key tiles it released."""
    dtype: gl.constexpr = o_desc.dtype
    D: gl.constexpr = o_desc.block_type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    # P goes to the P V matmul from registers: the score accumulator's layout already is the operand's.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = first_row + gl.arange(0, BLOCK_M, layout=row_s)  # query positions in the sequence
    if CAUSAL:
        n_full = first_row // BLOCK_N  # key tiles every row of this consumer sees whole
        n_mine = gl.cdiv(first_row + BLOCK_M, BLOCK_N)  # key tiles it needs; the program may load more
    else:
        n_full = n_tiles
        n_mine = n_tiles

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    # Tile 0: scores and softmax only; its P V is issued beside tile 1's scores (or after the loops).
    mbarrier.wait(k_ready.index(0), 0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    if CAUSAL:
        if n_full == 0:
            s = _causal_mask(s, rows, 0, BLOCK_N, s_layout)
    p32, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
    p = gl.convert_layout(p32.to(dtype), p_layout)

    for j in range(1, n_full):
        acc, p, m_i, l_i = _key_tile(j, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows,
                                     qk_scale, False, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
    if CAUSAL:  # the diagonal band
        for j in range(gl.maximum(n_full, 1), n_mine):
            acc, p, m_i, l_i = _key_tile(j, q, k_smem, v_smem, k_ready, v_ready, kv_empty, acc, p, m_i, l_i, rows,
                                         qk_scale, True, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, p_layout)

    last = n_mine - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc_tok = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    mbarrier.arrive(kv_empty.index(last % STAGES), count=1)

    # Every row saw at least one key (causal row r sees key 0), so l_i > 0.
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # This consumer's rows of Q are dead (its last score matmul retired): they hold O on its way out.
    q.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q)
    lse = (m_i + gl.log2(l_i)) * LN2  # log2 -> natural log
    gl.store(L + lse_row + gl.arange(0, BLOCK_M, layout=row_s), lse)
    tma.store_wait(pendings=0)
    return n_mine


@gluon.jit
def _consumer(o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0, lse_base, N,
              n_tiles, qk_scale, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    first_row = m0 + CONSUMER * BLOCK_M
    mbarrier.wait(q_ready, 0)
    if first_row < N:  # the last program's last consumers may have no rows (N % BLOCK_M == 0)
        n_done = _attend(o_desc, L, q_smem.index(CONSUMER), k_smem, v_smem, k_ready, v_ready, kv_empty,
                         q_row + CONSUMER * BLOCK_M, q_col, first_row, lse_base + CONSUMER * BLOCK_M, n_tiles,
                         qk_scale, CAUSAL, BLOCK_M, BLOCK_N, STAGES)
    else:
        n_done = 0
    # Tiles past this consumer's last row (causal) are still loaded for the others: release them once loaded, so
    # an arrival never counts toward a slot's previous use.
    for j in range(n_done, n_tiles):
        mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)


@gluon.jit
def attn_fwd_hopper(
    q_desc, k_desc, v_desc, o_desc, L,
    q_rows_b, q_rows_h, q_cols_h, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    H, N, qk_scale,
    CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """O and L for NUM_CONSUMERS * BLOCK_M query rows of one (batch, head); N % BLOCK_M == N % BLOCK_N == 0.

    Q, K, V and O are 2-D descriptors over their storage: row b * rows_b + h * rows_h + position, column
    h * cols_h. That covers (batch, heads, seq, d) and (batch, seq, heads, d) memory alike.
    """
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = q_desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M * NUM_CONSUMERS

    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest rows first, for a better tail
        n_tiles = gl.cdiv(gl.minimum((pid_m + 1) * ROWS, N), BLOCK_N)
    else:
        pid_m = gl.program_id(0)
        n_tiles = N // BLOCK_N
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * ROWS

    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the initialised barriers, visible to the TMA unit

    q_row = b * q_rows_b + h * q_rows_h + m0
    q_col = h * q_cols_h
    lse_base = bh * N + m0
    k_row = b * k_rows_b + h * k_rows_h
    v_row = b * v_rows_b + h * v_rows_h
    # Worker partitions take no distributed tensors, so each consumer's arguments are spelled out.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0,
                         lse_base, N, n_tiles, qk_scale, 0, CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0,
                         lse_base, N, n_tiles, qk_scale, 1, CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         q_row, q_col, k_row, h * k_cols_h, v_row, h * v_cols_h, n_tiles, BLOCK_N, STAGES,
                         NUM_CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.static_assert(NUM_CONSUMERS == 3, "2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0,
                         lse_base, N, n_tiles, qk_scale, 0, CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0,
                         lse_base, N, n_tiles, qk_scale, 1, CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (o_desc, L, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, q_col, m0,
                         lse_base, N, n_tiles, qk_scale, 2, CAUSAL, BLOCK_M, BLOCK_N, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         q_row, q_col, k_row, h * k_cols_h, v_row, h * v_cols_h, n_tiles, BLOCK_N, STAGES,
                         NUM_CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
