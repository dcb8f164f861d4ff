"""`flash`: FlashAttention-2 with a fused forward and backward, and O(seq) memory (docs/flash.md).

api.py registers the backend; dispatch.py chooses between the Triton kernels (triton/), which run every input, and
the Gluon kernels for Hopper (hopper/), which run the inputs they support faster; reference.py is `flash-torch`, the
readable specification; decode/ the split-KV decode paths.

    from attention.flash import choose_kernels, use_kernels, FlashAttentionTriton, FlashAttentionTorch
"""

from attention.flash.api import FlashAttention, flash_attention
from attention.flash.dispatch import (KernelChoice, choose_kernels, flash_backward, flash_forward, kernels_in_use,
                                      use_kernels)
from attention.flash.triton.host import Tiles

# Registered after "flash", so list_attention() shows the kernel before its specification.
from attention.flash.reference import FlashAttentionTorch  # noqa: E402  isort: skip
from attention.flash.decode import host as _decode  # noqa: E402,F401  isort: skip  (registers the decode paths)

FlashAttentionTriton = FlashAttention  # the CS336 assignment's name for it

__all__ = ["FlashAttention", "FlashAttentionTorch", "FlashAttentionTriton", "KernelChoice", "Tiles", "choose_kernels",
           "flash_attention", "flash_backward", "flash_forward", "kernels_in_use", "use_kernels"]
