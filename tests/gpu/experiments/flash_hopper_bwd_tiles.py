"""Experiment: backward tiles for the Gluon Hopper kernels that no longer spill in their loops.

The eighth session kept dK/dV at 32-row query tiles for d 128 because 64-row tiles spilled (3.89 against 1.98 ms).
The ninth session moved L and delta into shared memory, freeing 32 registers per consumer thread. Compiled offline
for sm_90 with triton 3.6 (`python -m attention.flash_hopper_resources`), dK/dV at d 128 with 64-row query tiles now
spills 20 bytes, all outside the loop. This times, on the same inputs and alternating, each kernel at its current
tiles (`backward_tiles_for`) and at the candidates, checks each candidate's gradients against an fp32 reference
(error no worse than the current tiles', bitwise repeatable), then the whole backward and forward+backward with the
best tiles against the current ones and cuDNN.
Outcome (H100, twelfth session, results/h100/2026-11-24-flash-hopper-bwd-tiles.txt): no candidate was faster; d-128
dK/dV with 64-row query tiles ran 1-2% slower than with 32-row ones, so the tiles stay. The whole-backward lines
time identical tiles twice when no candidate wins, and the second ran 3-5% slower every time: an order effect.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_hopper_bwd_tiles.py [shape index ...]
"""

from __future__ import annotations

import math
import sys
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from attention import flash_hopper as fh
from attention import flash_triton as ft
from attention.flash_hopper import HopperTiles as T

SHAPES = [(2, 16, 8192, 128, True), (2, 16, 8192, 128, False), (1, 16, 16384, 64, True), (2, 16, 8192, 64, False)]
CANDIDATES = {  # by head dim, beside the current tiles
    "dkdv": {128: [T(2, 64, 4), T(2, 64, 3)], 64: [T(3, 32, 4)]},
    "dq": {128: [T(2, 64, 3)], 64: [T(2, 128, 3)]},
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn) -> float:
    return do_bench(fn, warmup=30, rep=200)


def alternating(variants: dict, rounds: int = 3) -> dict[str, float]:
    """The median over `rounds` of each variant's do_bench median, the variants timed in turn."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(bench(fn))
    return {name: sorted(x)[len(x) // 2] for name, x in times.items()}


def main(indices: list[int]) -> None:
    for index in indices:
        b, h, n, d, causal = SHAPES[index]
        g = torch.Generator(device="cuda").manual_seed(index)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = 1 / math.sqrt(d)
        o, lse = ft.flash_forward(q, k, v, causal, scale)
        delta = ft._delta(o, do)
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, scale=scale)
        ref = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(o32, (q32, k32, v32), do.float())))
        del o32, q32, k32, v32
        current = fh.backward_tiles_for(d, n, b * h, fh._sm_count(0))
        flops = 2 * b * h * n * n * d / (2 if causal else 1)
        print(f"\n{(b, h, n, d, causal)} current tiles {current}", flush=True)

        best = dict(current)
        for kernel, matmuls in (("dkdv", 4), ("dq", 3)):
            outs = {name: torch.empty_like(q) for name in ("dq", "dk", "dv")}

            def launch(t, outs=outs, kernel=kernel):
                if kernel == "dkdv":
                    fh.backward_dkdv(q, k, v, do, lse, delta, outs["dk"], outs["dv"], causal, scale, t)
                else:
                    fh.backward_dq(q, k, v, do, lse, delta, outs["dq"], causal, scale, t)

            names = ("dk", "dv") if kernel == "dkdv" else ("dq",)
            errors, variants = {}, {}
            for t in [current[kernel]] + CANDIDATES[kernel][d]:
                for name in names:
                    outs[name].fill_(float("nan"))
                launch(t)
                first = {name: outs[name].clone() for name in names}
                launch(t)
                torch.cuda.synchronize()
                same = all(torch.equal(first[name], outs[name]) for name in names)
                errors[t] = max(rel(outs[name], ref[name]) for name in names)
                print(f"  {kernel} {t}: rel err vs fp32 {errors[t]:.3e}, bitwise repeatable {same}", flush=True)
                if same and errors[t] <= 1.05 * errors[current[kernel]]:
                    variants[t] = lambda t=t: launch(t)
            med = alternating(variants)
            for t, ms in med.items():
                print(f"  {kernel} {t}: {ms:.4f} ms, {matmuls * flops / ms / 1e9:.0f} TFLOP/s, "
                      f"{ms / med[current[kernel]]:.3f} x current", flush=True)
            best[kernel] = min(med, key=med.get)

        def backward_with(tiles):
            return lambda: fh.backward(q, k, v, do, lse, delta, *(torch.empty_like(t) for t in (q, k, v)),
                                       causal, scale, tiles)

        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def flash_fwd_bwd(tiles):
            def run():
                with mock.patch.object(fh, "backward_tiles_for", lambda *a: dict(tiles)):
                    torch.autograd.grad(ft.flash_attention(qg, kg, vg, causal, scale), (qg, kg, vg), do)
            return run

        def cudnn_fwd_bwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
            torch.autograd.grad(out, (qg, kg, vg), do)

        bwd = alternating({"current": backward_with(current), "best": backward_with(best)})
        fb = alternating({"current": flash_fwd_bwd(current), "best": flash_fwd_bwd(best), "cudnn": cudnn_fwd_bwd})
        print(f"SUMMARY {(b, h, n, d, causal)} best {best} | backward {bwd['best']:.4f} vs current "
              f"{bwd['current']:.4f} ({bwd['best'] / bwd['current']:.3f}) | fwd+bwd best {fb['best']:.4f}, current "
              f"{fb['current']:.4f}, cuDNN {fb['cudnn']:.4f} (best/cuDNN {fb['best'] / fb['cudnn']:.3f})", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or list(range(len(SHAPES))))
