"""`sdpa` (PyTorch picks the kernel) and pinned SDPA kernels, the peers we benchmark against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention.registry import register


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): the fused SDPA kernels want four dims."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape(-1, t.shape[-3], t.shape[-2], t.shape[-1])


def _sdpa(q, k, v, causal, scale):
    o = F.scaled_dot_product_attention(_as_4d(q), _as_4d(k), _as_4d(v), is_causal=causal, scale=scale)
    return o.reshape(q.shape)


register("sdpa", description="torch.nn.functional.scaled_dot_product_attention; PyTorch picks the kernel")(_sdpa)


def _needs_cuda() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def _half_precision_head_dim(max_d: int):
    def check(q, k, v, causal):
        if q.device.type != "cuda":
            return f"needs CUDA tensors, got {q.device.type}"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16, got {q.dtype}"
        if q.shape[-1] > max_d or q.shape[-1] % 8:
            return f"needs d_head a multiple of 8 and <= {max_d}, got {q.shape[-1]}"
        return None

    return check


def _pinned(kernel: SDPBackend):
    def run(q, k, v, causal, scale):
        with sdpa_kernel(kernel):
            return _sdpa(q, k, v, causal, scale)

    return run


# SDPA pinned to one of its CUDA kernels: name, kernel, description, largest head dim it takes.
for _name, _kernel, _what, _max_d in (
    ("sdpa-flash", SDPBackend.FLASH_ATTENTION, "its FlashAttention-2 CUDA kernel", 256),
    ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, "its cuDNN kernel", 128),
):
    register(_name, description=f"SDPA pinned to {_what} (peer)", environment_check=_needs_cuda,
             input_check=_half_precision_head_dim(_max_d))(_pinned(_kernel))
