"""The Gluon dK/dV kernel of the working tree (`new`) against earlier versions, same inputs, calls alternating.

`old` is the eighth session's kernel, which loads L and delta with per-thread global loads: make the copy with
`git show 373c79f:attention/flash_hopper_kernels.py > tests/gpu/experiments/_old_flash_hopper_kernels.py` (the
`_*_flash_hopper_kernels.py` copies are git-ignored: carry them to the GPU machine). Copies named `_base_...` and
`_single_...`, if present, must take the working tree's arguments (L and delta as 1-D descriptors). Per shape:
bitwise equality with `old`, the dK/dV medians (three alternating do_bench medians each), dQ against the old dQ
kernel, then flash and cuDNN forward+backward.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_hopper_dkdv_ab.py [shape index ...]"""

import functools
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from attention import flash_hopper as fh
from attention.flash_triton import FlashAttentionTriton, _delta

SHAPES = [(1, 16, 16384, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False), (1, 16, 4096, 64, True)]
EXTRA_DKDV = {0: [fh.HopperTiles(2, 64, 3)], 2: [fh.HopperTiles(2, 64, 4)]}  # other tiles, same kernels



def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


old = load("old_kernels", "tests/gpu/experiments/_old_flash_hopper_kernels.py")
# Optional: a second kernel with the working tree's signature, e.g. the commit before the change under test.
OTHERS = {name: load(f"{name}_kernels", f"tests/gpu/experiments/_{name}_flash_hopper_kernels.py")
          for name in ("base", "single") if os.path.exists(f"tests/gpu/experiments/_{name}_flash_hopper_kernels.py")}


def dkdv_with(module, stats_in_smem, q, k, v, do, lse, delta, dk, dv, causal, scale, t):
    """Launch `module`'s dK/dV kernel; L and delta go as pointers (the eighth session's) or as 1-D descriptors."""
    import triton

    b, h, n, d = q.shape
    descs, indices = fh._backward_inputs(q, k, v, do, t.block_n, t.block_m)
    stats = (fh._row_stats_descriptor(lse, t.block_n), fh._row_stats_descriptor(delta, t.block_n)) \
        if stats_in_smem else (lse, delta)
    module.attn_bwd_dkdv_hopper[(triton.cdiv(n, t.rows), b * h)](
        *descs, fh._output_descriptor(dk, indices[1], t.block_m), fh._output_descriptor(dv, indices[2], t.block_m),
        *stats, *(x for index in indices for x in index), h, n, scale * math.log2(math.e), scale,
        **fh._meta(t, causal),
    )


old_dkdv = functools.partial(dkdv_with, old, False)


def old_dq(q, k, v, do, lse, delta, dq, causal, scale, t):
    import triton

    b, h, n, d = q.shape
    descs, indices = fh._backward_inputs(q, k, v, do, t.block_m, t.block_n)
    old.attn_bwd_dq_hopper[(triton.cdiv(n, t.rows), b * h)](
        *descs, fh._output_descriptor(dq, indices[0], t.block_m), lse, delta,
        *(x for index in indices for x in index), h, n, scale * math.log2(math.e), scale, **fh._meta(t, causal),
    )


def alternating(variants, args, flops, label):
    """Median of three do_bench medians per variant, the variants timed in turn; prints and returns them."""
    times = {name: [] for name, _ in variants}
    for _ in range(3):
        for name, fn in variants:
            times[name].append(bench(lambda: fn(*args)))
    med = {name: sorted(x)[1] for name, x in times.items()}
    for name in times:
        print(f"  {label} {name}: {' '.join(f'{x:.4f}' for x in times[name])} ms, median {med[name]:.4f} "
              f"({flops / med[name] / 1e9:.0f} TF/s)")
    return med


def bench(fn):
    return do_bench(fn, warmup=30, rep=200)


def main(indices):
    for i in indices:
        b, h, n, d, causal = SHAPES[i]
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        o = FlashAttentionTriton.apply(q, k, v, causal)
        lse = next(t for t in o.grad_fn.saved_tensors if t.dtype == torch.float32)
        with torch.no_grad():
            delta = _delta(o, do)
        t = fh.backward_tiles_for(d, n, b * h, fh._sm_count(0))["dkdv"]
        variants = [("old", old_dkdv)] + [(name, functools.partial(dkdv_with, m, True)) for name, m in OTHERS.items()]
        variants.append(("new", fh.backward_dkdv))
        outs = {}
        for name, fn in variants:
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            fn(q.detach(), k.detach(), v.detach(), do, lse, delta, dk, dv, causal, scale, t)
            outs[name] = (dk, dv)
        torch.cuda.synchronize()
        same = {name: all(torch.equal(a, b) for a, b in zip(outs["old"], outs[name])) for name in outs}
        print(f"{SHAPES[i]} dkdv tiles {t}: bitwise equal to old: {same}")
        dk, dv = outs["new"]
        flops = 2 * b * h * n * n * d / (2 if causal else 1)
        for other in EXTRA_DKDV.get(i, []):
            for name, fn in list(variants[1:]):
                variants.append((f"{name} {other}", lambda *a, fn=fn, other=other: fn(*a[:-1], other)))
        med = alternating(variants, (q.detach(), k.detach(), v.detach(), do, lse, delta, dk, dv, causal, scale, t),
                          4 * flops, "dkdv")
        ratio = " ".join(f"{name}/old {med[name] / med['old']:.3f}" for name in med if name != "old")
        tq = fh.backward_tiles_for(d, n, b * h, fh._sm_count(0))["dq"]
        dqs = {}
        for name, fn in (("old", old_dq), ("new", fh.backward_dq)):
            dqs[name] = torch.full_like(q, float("nan"))
            fn(q.detach(), k.detach(), v.detach(), do, lse, delta, dqs[name], causal, scale, tq)
        torch.cuda.synchronize()
        print(f"  dq tiles {tq}: new bitwise equal to old: {torch.equal(dqs['old'], dqs['new'])}")
        med = alternating([("old", old_dq), ("new", fh.backward_dq)],
                          (q.detach(), k.detach(), v.detach(), do, lse, delta, dqs["new"], causal, scale, tq),
                          3 * flops, "dq")
        ratio += f" | dq new/old {med['new'] / med['old']:.3f}"

        def flash_fb():
            q.grad = k.grad = v.grad = None
            FlashAttentionTriton.apply(q, k, v, causal).backward(do)

        def cudnn_fb():
            q.grad = k.grad = v.grad = None
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)

        fb = {name: bench(fn) for name, fn in (("flash", flash_fb), ("cudnn", cudnn_fb), ("flash2", flash_fb))}
        print(f"SUMMARY {SHAPES[i]} dkdv {ratio} | fwd+bwd flash {fb['flash']:.4f} / {fb['flash2']:.4f} "
              f"cuDNN {fb['cudnn']:.4f} (flash/cuDNN {min(fb['flash'], fb['flash2']) / fb['cudnn']:.3f})")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or range(len(SHAPES)))
