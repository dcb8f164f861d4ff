"""flash's two backward modes against SDPA's cuDNN on a Hopper GPU: the default (fused: the dK/dV kernel adds dQ with
TMA reductions) and the deterministic one (dK/dV and dQ kernels side by side), forward+backward and backward alone,
bf16, the Hopper kernels at every size, triton.testing.do_bench medians, every backend on the same inputs.

    python scripts/backward_modes_bench.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention.flash import choose_kernels  # noqa: E402
from attention.flash.api import FlashAttention  # noqa: E402
from attention.flash.hopper import inputs as hopper_inputs  # noqa: E402

# (batch, heads, kv heads, seq, d_head, causal)
SHAPES = [(1, 16, 16, 16384, 64, True), (1, 16, 16, 4096, 64, True), (16, 12, 12, 1024, 64, True),
          (4, 20, 20, 1024, 64, True), (2, 16, 16, 8192, 64, False), (8, 16, 4, 4096, 64, True),
          (2, 16, 16, 8192, 128, True), (8, 16, 16, 2048, 128, True), (4, 16, 16, 2048, 128, True),
          (2, 16, 16, 8192, 128, False), (8, 16, 4, 4096, 128, True), (1, 64, 8, 8192, 128, True),
          (1, 32, 32, 32768, 128, True)]


def times_ms(attend, q, k, v, do) -> tuple[float, float]:
    """(forward+backward, backward alone) of attend(q, k, v)."""
    def step():
        attend(q, k, v).backward(do)

    total = do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v])
    out = attend(q, k, v)
    backward = do_bench(lambda: out.backward(do, retain_graph=True), warmup=25, rep=200, grad_to_none=[q, k, v])
    return total, backward


def main() -> None:
    # the Hopper kernels at any size, as graphed calls run them
    hopper_inputs.MIN_SCORES = hopper_inputs.min_scores_at_every_head_dim(0, 0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms forward+backward / backward alone; "
          "ratio = cuDNN's time / flash's")
    for b, h, kv, n, d, causal in SHAPES:
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for heads in (h, kv, kv))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = d ** -0.5
        rows = {mode: times_ms(lambda q, k, v: FlashAttention.apply(q, k, v, causal, scale, None, None, None,
                                                                     mode == "deterministic"), q, k, v, do)
                for mode in ("default", "deterministic")}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            rows["cudnn"] = times_ms(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=kv != h), q, k, v, do)
        mode = choose_kernels(q, k, v, causal, replayed=True).backward_reason.split("; ")[-1].split(":")[0]
        flop = 4 * b * h * n * n * d * (0.5 if causal else 1) * 2.5
        cells = " | ".join(f"{name} {t:.3f} / {bw:.3f}" for name, (t, bw) in rows.items())
        ratios = " ".join(f"{name} {rows['cudnn'][0] / t:.3f} / {rows['cudnn'][1] / bw:.3f}"
                          for name, (t, bw) in rows.items() if name != "cudnn")
        print(f"B{b} H{h} KV{kv} N{n} D{d} {'causal' if causal else 'full'} [{mode[:40]}]: {cells} | ratio {ratios} "
              f"| default backward {flop / rows['default'][1] / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
