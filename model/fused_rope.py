"""q, k and v out of the fused qkv projection, with RoPE applied to q and k: one kernel forward, one backward.

The attention layer splits the projection (batch, seq, (heads + 2 kv_heads) * d_head) into q (batch, seq, heads,
d_head) and k, v (batch, seq, kv_heads, d_head), each in storage of its own, with q and k rotated. In PyTorch ops
(`split_rotate_reference`) Inductor makes that two kernels forward and one backward, which gathers dq, dk and dv into
the projection's gradient through zero-filled buffers. On CUDA, `split_rotate` runs one Triton kernel each way
(model/rope_kernels.py), each reading and writing every element once; elsewhere it runs the PyTorch ops.
"""

from __future__ import annotations

import einx
import torch

from model.layers import RotaryEmbedding


def split_heads(qkv: torch.Tensor, n_heads: int,
                n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (batch, seq, (n_heads + 2 n_kv_heads) * d_head) -> views q (batch, seq, n_heads, d_head), k and v
    (batch, seq, n_kv_heads, d_head)."""
    # Head counts, not d_head, name the splits: ints also where the compiler makes sizes symbolic. Views, not
    # torch.split: the compiled backward of a split is a concatenation, twice as slow.
    if n_heads == n_kv_heads:
        q, k, v = einx.id("b s (three h d) -> three b s h d", qkv, three=3, h=n_heads)
        return q, k, v
    d_head = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
    q, kv = qkv.split([n_heads * d_head, 2 * n_kv_heads * d_head], dim=-1)
    k, v = einx.id("b s (two h d) -> two b s h d", kv, two=2, h=n_kv_heads)
    return einx.id("b s (h d) -> b s h d", q, h=n_heads), k, v


def split_rotate_reference(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_rotate in PyTorch ops: autograd gives its backward."""
    q, k, v = split_heads(qkv, n_heads, n_kv_heads)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over the heads
    return RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin), v.contiguous()


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """cos and sin as (batch or 1, seq, d_head / 2) contiguous fp32, and their batch and seq strides (batch stride
    0 when every row shares them)."""
    cos, sin = (t.float().contiguous() for t in (cos, sin))
    shared = cos.dim() == 2 or cos.shape[0] == 1
    return cos, sin, 0 if shared else cos.stride(0), cos.stride(-2)


def _blocks(n_heads: int, n_kv_heads: int, half: int) -> dict:
    # A program holds each part's pairs at once: blocks of pairs, in powers of two.
    return dict(BLOCK_Q=_next_power_of_2(n_heads * half), BLOCK_KV=_next_power_of_2(n_kv_heads * half),
                num_warps=4 if n_heads * half <= 2048 else 8)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# The kernels launch through torch.library.wrap_triton, as a triton_op's body must for torch.compile to see them;
# called eagerly (and in the CPU interpreter) it launches them directly.


def launch_split_rotate(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_rotate's forward kernel: (q, k, v), contiguous. qkv (batch, seq, width) with a contiguous last dim;
    cos, sin (seq, d_head / 2) or (batch, seq, d_head / 2)."""
    from model.rope_kernels import split_rotate as kernel  # on first use: TRITON_INTERPRET is read at import

    b, s, width = qkv.shape
    d_head = width // (n_heads + 2 * n_kv_heads)
    q = qkv.new_empty(b, s, n_heads, d_head)
    k, v = qkv.new_empty(b, s, n_kv_heads, d_head), qkv.new_empty(b, s, n_kv_heads, d_head)
    cos, sin, angle_stride_b, angle_stride_s = _angles(cos, sin)
    torch.library.wrap_triton(kernel)[(b * s,)](
        qkv, q, k, v, cos, sin, s, qkv.stride(0), qkv.stride(1), angle_stride_b, angle_stride_s,
        H=n_heads, KV=n_kv_heads, HALF=d_head // 2, **_blocks(n_heads, n_kv_heads, d_head // 2))
    return q, k, v


def launch_merge_rotate_back(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """split_rotate's backward kernel: dqkv (batch, seq, (heads + 2 kv_heads) * d_head), contiguous."""
    from model.rope_kernels import merge_rotate_back as kernel

    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    b, s, n_heads, d_head = dq.shape
    n_kv_heads = dk.shape[2]
    dqkv = dq.new_empty(b, s, (n_heads + 2 * n_kv_heads) * d_head)
    cos, sin, angle_stride_b, angle_stride_s = _angles(cos, sin)
    torch.library.wrap_triton(kernel)[(b * s,)](
        dq, dk, dv, dqkv, cos, sin, s, *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        angle_stride_b, angle_stride_s, H=n_heads, KV=n_kv_heads, HALF=d_head // 2,
        **_blocks(n_heads, n_kv_heads, d_head // 2))
    return dqkv


@torch.library.triton_op("flash_lm::split_rotate", mutates_args=())
def _split_rotate_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                     n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_split_rotate(qkv, n_heads, n_kv_heads, cos, sin)


@torch.library.triton_op("flash_lm::merge_rotate_back", mutates_args=())
def _merge_rotate_back_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
    return launch_merge_rotate_back(dq, dk, dv, cos, sin)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return _merge_rotate_back_op(dq, dk, dv, cos, sin), None, None, None, None


_split_rotate_op.register_autograd(_backward, setup_context=_setup_context)


def split_rotate(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (batch, seq, (n_heads + 2 n_kv_heads) * d_head) -> q (batch, seq, n_heads, d_head), k and v (batch, seq,
    n_kv_heads, d_head), each contiguous, q and k rotated by the angles whose cos and sin are (seq, d_head / 2) or
    (batch, seq, d_head / 2). The Triton kernels on CUDA, PyTorch ops elsewhere."""
    width, seq, half = qkv.shape[-1], qkv.shape[-2], cos.shape[-1]
    if width != (n_heads + 2 * n_kv_heads) * 2 * half or cos.shape[-2] != seq or sin.shape != cos.shape:
        raise ValueError(f"split_rotate: qkv (..., {seq}, {width}) needs ({n_heads} + 2 x {n_kv_heads}) heads of "
                         f"d_head {2 * half} and angles for {seq} positions; got cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)}")
    if qkv.is_cuda and qkv.stride(-1) == 1:
        return _split_rotate_op(qkv, cos, sin, n_heads, n_kv_heads)
    return split_rotate_reference(qkv, n_heads, n_kv_heads, cos, sin)
