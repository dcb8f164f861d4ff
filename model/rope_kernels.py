"""The Triton kernels of model.fused_rope: q, k and v out of the fused projection with RoPE applied, and back.

One program per token: it reads the token's row of every head once and writes it once, rotating the pairs
(x[2i], x[2i+1]) of the q and k heads in fp32. Imported on first use, so that TRITON_INTERPRET (the CPU interpreter,
for tests) is read after it is set.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src, src_head_stride, dst, dst_head_stride, cos, sin, n_heads,
                  HALF: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr, SIGN: tl.constexpr):
    """dst[head, :] = src[head, :] rotated by the angles of cos and sin ((HALF,) each), for heads < n_heads.
    SIGN -1 rotates back (the transpose). BLOCK: pairs, a power of two >= n_heads * HALF."""
    pair = tl.arange(0, BLOCK)
    head, i = pair // HALF, pair % HALF
    mask = (pair < n_heads * HALF)[:, None]
    # (BLOCK, 2): each pair's two elements, next to each other in memory.
    col = 2 * i[:, None] + tl.arange(0, 2)[None, :]
    x = tl.load(src + head[:, None] * src_head_stride + col, mask=mask)
    if ROTATE:
        x1, x2 = tl.split(x.to(tl.float32))
        c = tl.load(cos + i)
        s = tl.load(sin + i) * SIGN
        x = tl.join(x1 * c - x2 * s, x1 * s + x2 * c)
    tl.store(dst + head[:, None] * dst_head_stride + col, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def split_rotate(qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, seq, qkv_stride_b, qkv_stride_s,
                 angle_stride_b, angle_stride_s, H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """qkv (batch, seq, (H + 2 KV) * 2 HALF), the last dim contiguous -> q (batch, seq, H, 2 HALF) and k, v
    (batch, seq, KV, 2 HALF), contiguous; q and k rotated by cos and sin ((batch or 1, seq, HALF), fp32)."""
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq, row % seq
    src = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s
    cos, sin = cos_ptr + b * angle_stride_b + s * angle_stride_s, sin_ptr + b * angle_stride_b + s * angle_stride_s
    D: tl.constexpr = 2 * HALF
    _rotate_heads(src, D, q_ptr + row * H * D, D, cos, sin, H, HALF, BLOCK_Q, True, 1.0)
    _rotate_heads(src + H * D, D, k_ptr + row * KV * D, D, cos, sin, KV, HALF, BLOCK_KV, True, 1.0)
    _rotate_heads(src + (H + KV) * D, D, v_ptr + row * KV * D, D, cos, sin, KV, HALF, BLOCK_KV, False, 1.0)


@triton.jit
def merge_rotate_back(dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, seq,
                      dq_stride_b, dq_stride_s, dq_stride_h, dk_stride_b, dk_stride_s, dk_stride_h,
                      dv_stride_b, dv_stride_s, dv_stride_h, angle_stride_b, angle_stride_s,
                      H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """The gradient of split_rotate: dq (batch, seq, H, 2 HALF) and dk, dv (batch, seq, KV, 2 HALF), any strides
    but a contiguous last dim -> dqkv (batch, seq, (H + 2 KV) * 2 HALF), contiguous, dq and dk rotated back."""
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq, row % seq
    cos, sin = cos_ptr + b * angle_stride_b + s * angle_stride_s, sin_ptr + b * angle_stride_b + s * angle_stride_s
    D: tl.constexpr = 2 * HALF
    dst = dqkv_ptr + row * (H + 2 * KV) * D
    _rotate_heads(dq_ptr + b * dq_stride_b + s * dq_stride_s, dq_stride_h, dst, D, cos, sin, H, HALF, BLOCK_Q,
                  True, -1.0)
    _rotate_heads(dk_ptr + b * dk_stride_b + s * dk_stride_s, dk_stride_h, dst + H * D, D, cos, sin, KV, HALF,
                  BLOCK_KV, True, -1.0)
    _rotate_heads(dv_ptr + b * dv_stride_b + s * dv_stride_s, dv_stride_h, dst + (H + KV) * D, D, cos, sin, KV,
                  HALF, BLOCK_KV, False, -1.0)
