"""flash's Gluon Hopper backward (attention/flash_hopper.py) against flash's Triton backward and cuDNN, one run.

For each shape: dQ, dK, dV of both flash backwards and of cuDNN against an fp32 reference (SDPA's memory-efficient
kernel on fp32 copies), whether the Hopper one repeats bitwise; then do_bench medians, on the same inputs, of the
Hopper dK/dV and dQ kernels alone for every config in CONFIGS, the whole backward (Hopper, Triton, cuDNN; the Hopper
one also timed as a CUDA graph and back to back, with the host's time to issue it), the forwards, and
forward+backward (flash, cuDNN), with the Hopper backward's dQ on a second stream and serial. Both flash backwards'
kernels are also timed apart with torch.profiler.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_hopper_bwd.py [shape index ...]"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from attention import flash_hopper as fh
from attention import flash_triton as ft
from attention.flash_hopper import HopperTiles

SHAPES = [(1, 16, 16384, 64, True), (1, 16, 4096, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False)]
T = HopperTiles
CONFIGS = {  # by head dim; None is flash_hopper.backward_tiles_for's choice
    "dkdv": {64: [None], 128: [None]},
    "dq": {64: [None], 128: [None]},
}

def bwd_flops(b, h, n, d, causal, matmuls):
    return matmuls * 2 * b * h * n * n * d / (2 if causal else 1)


@contextlib.contextmanager
def switched_off(name):
    os.environ[name] = "0"
    try:
        yield
    finally:
        del os.environ[name]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn):
    return do_bench(fn, warmup=30, rep=200)


def kernel_times(fn, iters=10):
    """Mean device ms per call of each kernel fn launches, by kernel name (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key[:40]: e.device_time_total / 1e3 / iters for e in prof.key_averages() if e.device_time_total > 0}


def timings(fn, calls=30):
    """do_bench's median, a CUDA graph's replay, back-to-back calls, and the host's time to issue one call."""
    import time

    ms_bench = bench(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms_graph = bench(graph.replay)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (f"do_bench {ms_bench:.4f} ms, graph replay {ms_graph:.4f} ms, back-to-back {(t2 - t0) / calls * 1e3:.4f} "
            f"ms, host issue {(t1 - t0) / calls * 1e3:.4f} ms per call")


def main(indices):
    for index in indices:
        b, h, n, d, causal = SHAPES[index]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d ** -0.5
        print(f"\n{(b, h, n, d, causal)}: backward problem={fh.backward_problem(q, k, v, do, causal)}", flush=True)
        o, lse = ft.flash_forward(q, k, v, causal, scale)
        delta = ft._delta(o, do)

        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, scale=scale)
        ref = torch.autograd.grad(o32, (q32, k32, v32), do.float())
        del o32, q32, k32, v32
        qc, kc, vc = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal, scale=scale)
        cudnn_bwd = lambda: torch.autograd.grad(oc, (qc, kc, vc), do, retain_graph=True)  # noqa: E731
        with switched_off("FLASH_HOPPER_BACKWARD"):
            g_triton = ft.flash_backward(q, k, v, o, lse, do, causal, scale)
        g_hopper = ft.flash_backward(q, k, v, o, lse, do, causal, scale)
        repeat = ft.flash_backward(q, k, v, o, lse, do, causal, scale)
        same = all(torch.equal(a, b) for a, b in zip(g_hopper, repeat))
        for name, grads in (("hopper", g_hopper), ("triton", g_triton), ("cuDNN", cudnn_bwd())):
            errs = " ".join(f"{x} {rel(gr, r):.2e}" for x, gr, r in zip(("dq", "dk", "dv"), grads, ref))
            print(f"  {name}: rel err vs fp32 {errs}", flush=True)
        worst = max(rel(a, r) / max(rel(t, r), 1e-4) for a, t, r in zip(g_hopper, g_triton, ref))
        print(f"  hopper bitwise repeatable: {same}; worst error ratio hopper/triton {worst:.2f} "
              f"{'OK' if same and worst < 1.5 else 'WRONG'}", flush=True)
        del g_triton, repeat, ref

        best = {}
        for kernel in ("dkdv", "dq"):
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            for t in CONFIGS[kernel][d]:
                t = t or fh.backward_tiles_for(d, n, b * h, 132)[kernel]
                if (2 * t.rows + 2 * t.stages * t.block_n) * d * 2 > 227 * 1024:
                    continue
                if kernel == "dkdv":
                    fn = lambda t=t: fh.backward_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, t)  # noqa: E731
                else:
                    fn = lambda t=t: fh.backward_dq(q, k, v, do, lse, delta, dq, causal, scale, t)  # noqa: E731
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # a config that does not fit is reported, not fatal
                    print(f"  {kernel} {t}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                ok = (rel(dk, g_hopper[1]) < 1e-2 and rel(dv, g_hopper[2]) < 1e-2) if kernel == "dkdv" else \
                    rel(dq, g_hopper[0]) < 1e-2
                ms = bench(fn)
                mm = 4 if kernel == "dkdv" else 3
                print(f"  {kernel} c{t.consumers} n{t.block_n} s{t.stages}: {ms:.4f} ms "
                      f"{bwd_flops(b, h, n, d, causal, mm) / ms / 1e9:.0f} TF/s {'OK' if ok else 'WRONG'}",
                      flush=True)
                if ok and (kernel not in best or ms < best[kernel][0]):
                    best[kernel] = (ms, f"c{t.consumers}n{t.block_n}s{t.stages}")

        ms_h = bench(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale))
        print("  whole Hopper backward: " + timings(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale)),
              flush=True)
        with switched_off("FLASH_HOPPER_BACKWARD"):
            ms_t = bench(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale))
            per_kernel = kernel_times(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale))
        ms_c = bench(cudnn_bwd)
        print(f"  triton kernels: " + ", ".join(f"{name} {ms:.4f}" for name, ms in per_kernel.items()))
        print(f"  hopper kernels: " + ", ".join(
            f"{name} {ms:.4f}" for name, ms in kernel_times(
                lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale)).items()))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def flash_fwd_bwd():
            out = ft.flash_attention(qg, kg, vg, causal, scale)
            torch.autograd.grad(out, (qg, kg, vg), do)

        def cudnn_fwd_bwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
            torch.autograd.grad(out, (qg, kg, vg), do)

        ms_f = bench(lambda: ft.flash_forward(q, k, v, causal, scale))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms_cf = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale))
        print(f"  forward: flash {ms_f:.4f} ms ({bwd_flops(b, h, n, d, causal, 2) / ms_f / 1e9:.0f} TF/s), cuDNN "
              f"{ms_cf:.4f} ms", flush=True)
        print("  flash fwd+bwd kernels: " + ", ".join(f"{name} {ms:.4f}" for name, ms in kernel_times(
            flash_fwd_bwd).items()), flush=True)
        ms_fb, ms_cfb = bench(flash_fwd_bwd), bench(cudnn_fwd_bwd)
        fh.OVERLAP_BACKWARD = False
        ms_h_serial = bench(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale))
        ms_fb_serial = bench(flash_fwd_bwd)
        fh.OVERLAP_BACKWARD = True
        print(f"  dQ on a second stream: bwd {ms_h:.4f} vs {ms_h_serial:.4f} serial, fwd+bwd {ms_fb:.4f} vs "
              f"{ms_fb_serial:.4f} serial, cuDNN {ms_c:.4f} / {ms_cfb:.4f}", flush=True)
        for name, fn in (("flash", flash_fwd_bwd), ("cuDNN", cudnn_fwd_bwd)):
            try:
                print(f"  {name} fwd+bwd: " + timings(fn), flush=True)
            except Exception as e:
                print(f"  {name} fwd+bwd timings failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        picks = " ".join(f"{kname} {ms:.4f} ({cfg})" for kname, (ms, cfg) in best.items())
        print(f"  SUMMARY {(b, h, n, d, causal)} bwd: hopper {ms_h:.4f} triton {ms_t:.4f} cuDNN {ms_c:.4f} "
              f"(hopper/cuDNN {ms_h / ms_c:.3f}) | best {picks} | fwd+bwd flash {ms_fb:.4f} cuDNN {ms_cfb:.4f} "
              f"({ms_fb / ms_cfb:.3f}) | fwd flash {ms_f:.4f} cuDNN {ms_cf:.4f}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or range(len(SHAPES)))
