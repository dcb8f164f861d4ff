"""Where eager calls should start to run flash's Hopper kernels (hopper/inputs.py, MIN_SCORES): an eager
forward+backward with each pass on the Triton or the Hopper kernels (TT, HT, TH, HH: forward then backward), against
SDPA's cuDNN, on a Hopper GPU, bf16, rounds taking turns, triton.testing.do_bench medians with the spread of the rounds.
The backward runs in its default mode (hopper/inputs.py, FUSED_MIN). Near the bounds the host's speed decides, so
compare processes.

    python scripts/hopper_eager_bounds.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention.flash import dispatch  # noqa: E402
from attention.flash.api import FlashAttention  # noqa: E402
from attention.flash.hopper import inputs as hopper_inputs  # noqa: E402

# (batch, heads, seq, d_head, causal): the sizes around the bounds
SHAPES = [(1, 1, 128, 64, True), (4, 20, 1024, 64, True), (4, 16, 1024, 64, True), (2, 16, 2048, 64, True),
          (16, 12, 1024, 64, True), (1, 16, 4096, 64, True), (4, 16, 2048, 64, True), (8, 12, 2048, 64, True),
          (2, 16, 2048, 64, False), (8, 32, 512, 128, True), (8, 16, 1024, 128, True), (4, 16, 2048, 128, True),
          (16, 12, 1024, 128, True)]
CONFIGS = ("TT", "HT", "TH", "HH")


def use(config: str) -> None:
    """Eager calls run each pass on the kernels `config` names, from their first call on."""
    bound = {"T": 2**62, "H": 0}
    hopper_inputs.MIN_SCORES = hopper_inputs.min_scores_at_every_head_dim(bound[config[0]], bound[config[1]])
    dispatch._plans.clear()  # plans keep the kernels their first call chose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms of an eager forward+backward, median "
          f"[min-max] of {rounds} rounds; ratio = cuDNN's median / each config's")
    for b, h, n, d, causal in SHAPES:
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = d ** -0.5
        times = {name: [] for name in (*CONFIGS, "cudnn")}
        for _ in range(rounds):
            for config in CONFIGS:
                use(config)
                times[config].append(do_bench(lambda: FlashAttention.apply(q, k, v, causal, scale).backward(do),
                                              warmup=25, rep=100, grad_to_none=[q, k, v]))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times["cudnn"].append(do_bench(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do),
                    warmup=25, rep=100, grad_to_none=[q, k, v]))
        median = {name: statistics.median(t) for name, t in times.items()}
        scores = b * h * n * n / (2 if causal else 1)
        cells = " ".join(f"{name} {median[name]:.3f} [{min(t):.3f}-{max(t):.3f}]" for name, t in times.items())
        ratios = " ".join(f"{c} {median['cudnn'] / median[c]:.3f}" for c in CONFIGS)
        print(f"B{b} H{h} N{n} D{d} {'causal' if causal else 'full'} 2^{math.log2(scores):.1f} | {cells} | "
              f"ratio {ratios}", flush=True)


if __name__ == "__main__":
    main()
