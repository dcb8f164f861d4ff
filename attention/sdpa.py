"""`sdpa` (PyTorch picks the kernel) and pinned SDPA kernels, the peers we benchmark against.

Variants: GQA natively (enable_gqa: K and V are not repeated). Windows and documents only through a
materialised boolean mask, O(batch * seq_q * seq_k) memory: refused beyond MAX_MASK_ELEMENTS. No softcap: SDPA takes
a mask, not a function of the scores. The pinned kernels run GQA only (FlashAttention-2 takes no mask at all).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention.masks import mask_elements, visible_mask
from attention.registry import kv_groups, register

# The largest boolean mask sdpa materialises: 2^28 elements (256 MiB), a (16384 x 16384) mask for one sequence.
MAX_MASK_ELEMENTS = 1 << 28


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): the fused SDPA kernels want four dims."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape(-1, t.shape[-3], t.shape[-2], t.shape[-1])


def _sdpa(q, k, v, causal, scale, window: Optional[int] = None, doc_ids: Optional[torch.Tensor] = None):
    extra = {"enable_gqa": True} if kv_groups(q, k) > 1 else {}
    mask = visible_mask(q.shape[-2], k.shape[-2], causal, window, doc_ids, q.device) if (
        window is not None or doc_ids is not None) else None
    if mask is not None:
        if doc_ids is not None:  # doc_ids.shape[:-1] + (n, n): one mask per sequence, shared by its heads
            mask = mask.unsqueeze(-3)
            if q.dim() > 4:  # the leading dims merge into one batch dim, the mask's with them
                mask = mask.expand(*q.shape[:-3], 1, *mask.shape[-2:])
            mask = _as_4d(mask)
        o = F.scaled_dot_product_attention(_as_4d(q), _as_4d(k), _as_4d(v), attn_mask=mask, scale=scale, **extra)
    else:
        o = F.scaled_dot_product_attention(_as_4d(q), _as_4d(k), _as_4d(v), is_causal=causal, scale=scale, **extra)
    return o.reshape(q.shape)


def _sdpa_variant_problem(q, k, v, causal, variant) -> Optional[str]:
    if variant.window is not None or variant.doc_ids is not None:
        elements = mask_elements(q.shape[-2], k.shape[-2], variant.doc_ids, tuple(q.shape[:-3]))
        if elements > MAX_MASK_ELEMENTS:
            return (f"windows and documents need a materialised boolean mask, here {elements / 2**20:.0f} MiB; "
                    f"sdpa refuses more than {MAX_MASK_ELEMENTS // 2**20} MiB (O(seq^2) memory)")
    return None


register("sdpa", description="torch.nn.functional.scaled_dot_product_attention; PyTorch picks the kernel",
         variants=("gqa", "window", "doc_ids"), variant_check=_sdpa_variant_problem)(_sdpa)


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
             input_check=_half_precision_head_dim(_max_d), variants=("gqa",))(_pinned(_kernel))
