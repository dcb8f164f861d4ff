"""Time tile configs of flash's Hopper forward and dK/dV kernels at d 128 against each other and cuDNN, bf16, on an
sm_90 GPU: what tiles_for and backward_tiles_for (attention/flash/hopper/tiles.py) were chosen from at that head dim.

Configs take turns over --rounds rounds (each round in the reverse order of the one before), and every timing is a
do_bench median, so a config's spread across rounds shows the machine's noise. The forward's error is against cuDNN's
output, the dK/dV kernel's against the dispatch's own tiles. dK/dV is timed alone and inside the whole backward (beside
the dQ kernel on its second stream).

    python scripts/hopper_tile_sweep.py [fwd] [dkdv] [--rounds 2] [--shapes "2,16,16,8192,1 4,16,16,4096,0"]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention.flash.common import sm_count  # noqa: E402
from attention.flash.hopper import host as hopper  # noqa: E402
from attention.flash.triton import host as ft  # noqa: E402  (the delta pre-pass the Hopper backward reads)
from attention.flash.hopper.inputs import gluon_problem  # noqa: E402
from attention.flash.hopper.tiles import HopperTiles as T, backward_tiles_for  # noqa: E402

D = 128
CANDIDATES = {"fwd": [T(3, 64, 3), T(2, 64, 4), T(2, 128, 2), T(2, 128, 3)],
              "dkdv": [T(2, 32, 4), T(2, 64, 4), T(2, 64, 3)]}
# (batch, query heads, key/value heads, seq, causal)
SHAPES = [(2, 16, 16, 8192, True), (2, 16, 16, 8192, False), (8, 16, 16, 2048, True), (4, 32, 8, 8192, True),
          (1, 32, 32, 32768, True)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def median_ms(fn, expected_ms: float) -> float:
    return do_bench(fn, warmup=max(25, 3 * expected_ms), rep=max(150, 25 * expected_ms), return_mode="median")


def shape_arg(text: str) -> list[tuple]:
    return [(b, h, h_kv, n, bool(c)) for b, h, h_kv, n, c in (map(int, s.split(",")) for s in text.split())]


def sweep(kernels: list[str], shapes: list[tuple], rounds: int) -> list[tuple]:
    rows = []  # (shape, what, ms, TFLOP/s, relative error)
    for b, h, h_kv, n, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, do = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(b, h_kv, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        scale, gqa = D ** -0.5, h_kv != h
        name = f"B{b} H{h}" + (f" KV{h_kv}" if gqa else "") + f" N{n} {'causal' if causal else 'full'}"
        fwd_flop = 4 * b * h * n * n * D / (2 if causal else 1)

        def add(what, ms, flop, err=0.0):
            rows.append((name, what, ms, flop / ms / 1e9, err))
            print(f"{name:28} {what:34} {ms:9.4f} ms {rows[-1][3]:5.0f} TFLOP/s err {err:.1e}", flush=True)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            add("cudnn fwd", median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                              enable_gqa=gqa), 1), fwd_flop)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            add("cudnn fwd+bwd", median_ms(lambda: F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=causal, enable_gqa=gqa).backward(do), 4), 3.5 * fwd_flop)
        o = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
        if "fwd" in kernels:
            for r in range(rounds):
                for t in CANDIDATES["fwd"][::1 if r % 2 == 0 else -1]:
                    o.fill_(float("nan"))  # every element must be written
                    hopper.forward(q, k, v, o, lse, causal, scale, tiles=t)
                    ms = median_ms(lambda: hopper.forward(q, k, v, o, lse, causal, scale, tiles=t), 1)
                    add(f"fwd c{t.consumers} n{t.block_n} s{t.stages} r{r}", ms, fwd_flop, rel(o, ref))
        if "dkdv" in kernels:
            hopper.forward(q, k, v, o, lse, causal, scale)
            delta = ft.delta_and_launch(o, do)[0]
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            hopper.backward(q, k, v, do, lse, delta, dq, dk, dv, causal, scale)
            dk_ref, dv_ref = dk.clone(), dv.clone()
            dq_tiles = backward_tiles_for(D, n, b * h, sm_count(0))["dq"]
            add("dq alone", median_ms(lambda: hopper.backward_dq(q, k, v, do, lse, delta, dq, causal, scale,
                                                                 dq_tiles), 3), 1.5 * fwd_flop)
            for r in range(rounds):
                for t in CANDIDATES["dkdv"][::1 if r % 2 == 0 else -1]:
                    dk.fill_(float("nan"))
                    dv.fill_(float("nan"))
                    hopper.backward_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, t)
                    err = max(rel(dk, dk_ref), rel(dv, dv_ref))
                    ms = median_ms(lambda: hopper.backward_dkdv(q, k, v, do, lse, delta, dk, dv, causal, scale, t), 3)
                    add(f"dkdv alone c{t.consumers} n{t.block_n} s{t.stages} r{r}", ms, 2 * fwd_flop, err)
                    ms = median_ms(lambda: hopper.backward(q, k, v, do, lse, delta, dq, dk, dv, causal, scale,
                                                           tiles={"dkdv": t}), 4)
                    add(f"backward, dkdv n{t.block_n} s{t.stages} r{r}", ms, 2.5 * fwd_flop, err)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help=f"any of {', '.join(CANDIDATES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", type=shape_arg, default=SHAPES,
                        help='"batch,heads,kv_heads,seq,causal ..." (causal 1 or 0)')
    args = parser.parse_args()
    unknown = set(args.kernels) - set(CANDIDATES)
    if unknown:
        parser.error(f"unknown kernels {', '.join(sorted(unknown))}: choose from {', '.join(CANDIDATES)}")
    if gluon_problem() is not None or not torch.cuda.is_available() \
            or torch.cuda.get_device_capability() != (9, 0):
        sys.exit(f"{sys.argv[0]} needs an sm_90 GPU and triton's Gluon")
    rows = sweep(args.kernels or list(CANDIDATES), args.shapes, args.rounds)
    print("\n| shape | what | ms | TFLOP/s | rel err |\n|---|---|---:|---:|---:|")
    for shape, what, ms, tflops, err in rows:
        print(f"| {shape} | {what} | {ms:.4f} | {tflops:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
