"""silu(gate) * up out of SwiGLU's fused gate/up projection: one kernel forward, one backward.

With w1 and w3 as one matmul (model.layers.SwiGLU), the projection (..., 2 d_ff) holds the gate (w1 x) and up (w3 x)
halves side by side. In PyTorch ops the backward of splitting it is a concatenation, which Inductor fuses into the
activation's backward as a kernel computing every element's branch with masked loads of both halves. On CUDA
`silu_mul` runs one Triton kernel each way (model/swiglu_kernels.py), each reading and writing every element once.
"""

from __future__ import annotations

import torch
import triton

BLOCK = 1024  # columns of a row per program


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul in PyTorch ops: autograd gives its backward."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, columns), a view where one exists, with a contiguous last dim."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


# The kernels launch through torch.library.wrap_triton, as a triton_op's body must for torch.compile to see them;
# called eagerly (and in the CPU interpreter) it launches them directly.


def launch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul's forward kernel: (..., d_ff), contiguous, from gate_up (..., 2 d_ff)."""
    from model.swiglu_kernels import silu_mul as kernel  # on first use: TRITON_INTERPRET is read at import

    d_ff = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = gate_up.new_empty(*gate_up.shape[:-1], d_ff)
    torch.library.wrap_triton(kernel)[(rows.shape[0], triton.cdiv(d_ff, BLOCK))](
        rows, out, d_ff, rows.stride(0), d_ff, BLOCK=BLOCK)
    return out


def launch_silu_mul_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """silu_mul's backward kernel: the gradient of gate_up (..., 2 d_ff), contiguous, from that of the output."""
    from model.swiglu_kernels import silu_mul_backward as kernel

    d_ff = gate_up.shape[-1] // 2
    rows, grad_rows = _rows(gate_up), _rows(grad)
    grad_gate_up = grad.new_empty(gate_up.shape)
    torch.library.wrap_triton(kernel)[(rows.shape[0], triton.cdiv(d_ff, BLOCK))](
        rows, grad_rows, grad_gate_up, d_ff, rows.stride(0), grad_rows.stride(0), BLOCK=BLOCK)
    return grad_gate_up


@torch.library.triton_op("flash_lm::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return launch_silu_mul(gate_up)


@torch.library.triton_op("flash_lm::silu_mul_backward", mutates_args=())
def _silu_mul_backward_op(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return launch_silu_mul_backward(gate_up, grad)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return _silu_mul_backward_op(gate_up, grad)


_silu_mul_op.register_autograd(_backward, setup_context=_setup_context)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2 d_ff), the gate half then the up half -> silu(gate) * up (..., d_ff), computed in fp32 and
    rounded once to gate_up's dtype. The Triton kernels on CUDA, PyTorch ops elsewhere."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up needs an even last dim (gate and up halves), got {tuple(gate_up.shape)}")
    if gate_up.is_cuda:
        return _silu_mul_op(gate_up)
    return silu_mul_reference(gate_up)
