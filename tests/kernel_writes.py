"""Which arguments each Triton kernel that torch.compile traces writes, as torch.compile's own analysis reads them.

Inductor runs a kernel launched through torch.library.wrap_triton (the body of a triton_op) on copies of the inputs
that analysis says the kernel writes. The analysis traces each store's address back to the kernel's arguments, through
whole @triton.jit calls: an address computed from the results of a helper that also took an input's pointer makes
that input look written, and costs a full copy of it on every call.

Run as `python -m tests.kernel_writes`: it calls each launcher of the fused RoPE, SwiGLU and flash Triton kernels
with small inputs, plain and with every attention variant, and prints one JSON object, kernel name -> the names of
the tensor arguments written, from `torch._higher_order_ops.triton_kernel_wrap`. The kernels are analysed, not run:
this needs compiled (not interpreted) Triton kernels, so it runs without TRITON_INTERPRET, and without a GPU it
analyses them for sm_90.
"""

from __future__ import annotations

import json
import os

assert not os.environ.get("TRITON_INTERPRET"), "analyse compiled kernels: unset TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap  # noqa: E402

WRITES: dict[str, set[str]] = {}


def _written(kernel: triton.runtime.JITFunction, args: dict) -> list[str]:
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # older releases: identify_mutated_tensors
        names = [d.name for d in triton_kernel_wrap.identify_accessed_tensors(kernel, args, {}).read_writes.writes]
    else:
        names = triton_kernel_wrap.identify_mutated_tensors(kernel, args, {})
    return [n for n in names if isinstance(args.get(n), torch.Tensor)]


class _Analysed:
    """Stands in for torch.library.wrap_triton: `_Analysed(kernel)[grid](*args, **kwargs)` records what the kernel
    writes and launches nothing."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            jit = self.kernel
            while not isinstance(jit, triton.runtime.JITFunction):  # an Autotuner or Heuristics around it
                jit = jit.fn
            bound = {**dict(zip(jit.arg_names, args)), **kwargs}
            WRITES.setdefault(jit.fn.__name__, set()).update(_written(jit, bound))
        return launch


class _Sm90:
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


def main() -> None:
    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(_Sm90())
    torch.library.wrap_triton = _Analysed
    from attention.flash.triton import host as flash
    from model import fused_rope, fused_swiglu

    gate_up = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    fused_swiglu.launch_silu_mul(gate_up)
    fused_swiglu.launch_silu_mul_backward(gate_up, torch.randn(2, 8, 32, dtype=torch.bfloat16))
    cos, sin = torch.randn(8, 8), torch.randn(8, 8)
    q, k, v = fused_rope.launch_split_rotate(torch.randn(2, 8, 4 * 16, dtype=torch.bfloat16), 2, 1, cos, sin)
    fused_rope.launch_merge_rotate_back(q, k, v, cos, sin)

    tiles = flash.Tiles(16, 16, 4, 1)
    doc_ids = torch.tensor([[0] * 20 + [1] * 44])
    for variant in ({}, {"window": 8, "softcap": 30.0, "doc_ids": doc_ids}):
        q = torch.randn(1, 4, 64, 32, dtype=torch.bfloat16)
        k, v = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16), torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
        o, lse = flash.forward(q, k, v, True, 0.2, tiles=tiles, traceable=True, **variant)
        flash.backward(q, k, v, o, lse, torch.randn_like(o), True, 0.2, tiles={"dkdv": tiles, "dq": tiles},
                       traceable=True, **variant)
    print(json.dumps({name: sorted(args) for name, args in WRITES.items()}))


if __name__ == "__main__":
    main()
