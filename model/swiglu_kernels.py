"""The Triton kernels of model.fused_swiglu: silu(gate) * up out of the fused gate/up projection, and back.

A program takes BLOCK columns of one row: it reads the gate and up halves of the row once, computes in fp32 and
writes once. Imported on first use, so that TRITON_INTERPRET (the CPU interpreter, for tests) is read after it is set.

The kernels load the projection themselves; their shared helper takes no pointer. torch.compile finds a kernel's
writes by tracing each store's address back to the arguments in its Triton IR, through whole calls: row and columns
out of a helper that also took the projection's pointer make the projection look written, and Inductor then copies
it before every launch (tests/test_kernel_writes.py checks that it does not).
"""

import triton
import triton.language as tl


@triton.jit
def _block(d_ff, BLOCK: tl.constexpr):
    """(row, columns, their mask) of this program's block: BLOCK columns of one row's d_ff."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < d_ff


@triton.jit
def silu_mul(gate_up_ptr, out_ptr, d_ff, gate_up_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """gate_up (rows, 2 d_ff), the last dim contiguous -> out (rows, d_ff) = silu(gate) * up."""
    row, cols, mask = _block(d_ff, BLOCK)
    src = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(src, mask=mask).to(tl.float32)
    up = tl.load(src + d_ff, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_backward(gate_up_ptr, grad_ptr, grad_gate_up_ptr, d_ff, gate_up_row_stride, grad_row_stride,
                      BLOCK: tl.constexpr):
    """The gradient of silu_mul: grad (rows, d_ff) -> grad_gate_up (rows, 2 d_ff), contiguous:
    d gate = grad * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))), d up = grad * silu(gate)."""
    row, cols, mask = _block(d_ff, BLOCK)
    src = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(src, mask=mask).to(tl.float32)
    up = tl.load(src + d_ff, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptr + row * grad_row_stride + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(gate)
    dst = grad_gate_up_ptr + row * 2 * d_ff + cols
    dtype = grad_gate_up_ptr.dtype.element_ty
    tl.store(dst, (grad * up * sig * (1 + gate * (1 - sig))).to(dtype), mask=mask)
    tl.store(dst + d_ff, (grad * gate * sig).to(dtype), mask=mask)
