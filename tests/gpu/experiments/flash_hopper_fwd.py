"""flash's Gluon Hopper forward (attention/flash_hopper.py) against flash's Triton forward and cuDNN, one run.

For each shape: the error of each forward against an fp32 reference (SDPA on fp32 copies), the lse difference
against the Triton kernel's, then do_bench medians of the forward alone for every Hopper config that fits, the
Triton kernel (autotuned) and SDPA cuDNN, on the same inputs. One shape also runs in (batch, seq, heads, d)
memory, and one through autograd (gradients against the Triton forward's).
`model` runs the shapes of the `large` and `small` training configs instead (batch, heads, 1024, 64).
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_hopper_fwd.py [model]"""

import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from attention import flash_hopper as fh
from attention import flash_triton as ft
from attention.flash_hopper import HopperTiles

SHAPES = [(1, 16, 16384, 64, True), (1, 16, 4096, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False)]
MODEL_SHAPES = [(4, 20, 1024, 64, True), (16, 12, 1024, 64, True)]  # large, small (2.7B's d_head 80 does not qualify)
CONFIGS = {  # None: flash_hopper.tiles_for's choice
    64: [None, HopperTiles(consumers=2, block_n=128, stages=3), HopperTiles(consumers=3, block_n=128, stages=2),
         HopperTiles(consumers=3, block_n=128, stages=3), HopperTiles(consumers=3, block_n=64, stages=4)],
    128: [None, HopperTiles(consumers=2, block_n=64, stages=4), HopperTiles(consumers=2, block_n=128, stages=2),
          HopperTiles(consumers=3, block_n=64, stages=3), HopperTiles(consumers=3, block_n=64, stages=4)],
}

def flops(b, h, n, d, causal):
    return 4 * b * h * n * n * d / (2 if causal else 1)


def hopper(q, k, v, causal, scale, tiles):
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    fh.forward(q, k, v, o, lse, causal, scale, tiles)
    return o, lse


@contextlib.contextmanager
def triton_forward():
    """flash's Triton forward kernel: the Hopper one switched off."""
    os.environ["FLASH_HOPPER_FORWARD"] = "0"
    try:
        yield
    finally:
        del os.environ["FLASH_HOPPER_FORWARD"]


def main(model: bool):
    for b, h, n, d, causal in MODEL_SHAPES if model else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        scale = d ** -0.5
        print(f"\n{(b, h, n, d, causal)}: problem={fh.forward_problem(q, k, v, causal)}", flush=True)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, scale=scale)
        with triton_forward():
            o_t, lse_t = ft.flash_forward(q, k, v, causal, scale)
        err_t = (o_t.float() - ref).abs().max().item()
        print(f"  triton: max |o - fp32 ref| {err_t:.3e}", flush=True)
        results = {}
        for t in CONFIGS[d]:
            try:
                o, lse = hopper(q, k, v, causal, scale, t)
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not fit (shared memory, registers) is reported, not fatal
                print(f"  {t}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = (o.float() - ref).abs().max().item()
            dl = (lse - lse_t).abs().max().item()
            ok = err <= 2 * err_t + 1e-3 and dl < 1e-3
            ms = do_bench(lambda: hopper(q, k, v, causal, scale, t), warmup=50, rep=300)
            results[t or "default"] = ms
            print(f"  {t}: err {err:.3e} lse diff {dl:.2e} {'OK' if ok else 'WRONG'}  {ms:.4f} ms "
                  f"{flops(b, h, n, d, causal) / ms / 1e9:.0f} TF/s", flush=True)
        with triton_forward():
            ms_t = do_bench(lambda: ft.flash_forward(q, k, v, causal, scale), warmup=50, rep=300)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms_c = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                            warmup=50, rep=300)
        for name, ms in (("flash triton", ms_t), ("cuDNN", ms_c)):
            print(f"  {name}: {ms:.4f} ms {flops(b, h, n, d, causal) / ms / 1e9:.0f} TF/s", flush=True)
        if results:
            best = min(results, key=results.get)
            print(f"  SUMMARY {(b, h, n, d, causal)} hopper best {results[best]:.4f} ms ({best}) | triton {ms_t:.4f} "
                  f"| cuDNN {ms_c:.4f} | hopper/cuDNN {results[best] / ms_c:.3f}", flush=True)

    # (batch, seq, heads, d) memory, as the model hands it over, and gradients through autograd.
    b, h, n, d = 2, 8, 2048, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    print(f"\nbshd {(b, h, n, d)}: problem={fh.forward_problem(q, k, v, True)}")
    o, lse = hopper(q, k, v, True, d ** -0.5, None)
    with triton_forward():
        o_t, lse_t = ft.flash_forward(q, k, v, True, d ** -0.5)
    print(f"  |o - triton| {(o.float() - o_t.float()).abs().max().item():.3e}  "
          f"|lse - triton| {(lse - lse_t).abs().max().item():.3e}")

    # Host time per call, on a shape whose kernels take a few microseconds.
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, fn in (("hopper", lambda: hopper(q, k, v, True, 0.125, None)),
                     ("triton", lambda: ft.flash_forward(q, k, v, True, 0.125, tiles=ft.Tiles(128, 64, 8, 3)))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        print(f"  host per call, {name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")


if __name__ == "__main__":
    main(model="model" in sys.argv[1:])
