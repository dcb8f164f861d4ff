"""Experiment: at B1 H16 N4096 D64 causal (bf16), is flash bound by its kernels or by the host, and would the Hopper
kernels be faster there if their launches cost nothing?

For flash on its Triton kernels (as dispatched now), flash forced onto the Hopper kernels (MIN_SCORES = 0) and SDPA's
cuDNN kernel: forward+backward through autograd, as bench_attention times it, three ways:
  do_bench   triton.testing.do_bench median (what the issue's table reports);
  gpu        GPU time alone: the GPU sleeps while the host queues the call, so its kernels run back to back;
  host       host time per call, with calls queued behind a sleeping GPU.
Then a cProfile of the Hopper path's host time. Usage: PYTHONPATH=. python3 tests/gpu/experiments/short_sequence_host_vs_gpu.py
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time

import torch
import triton

from attention import flash_hopper, get_attention
from tests.gpu.experiments.linear_fp32_weight_grad import gpu_ms  # GPU time alone: the sleep trick

B, H, N, D = 1, 16, 4096, 64


@contextlib.contextmanager
def forced_min_scores(value: int):
    """flash_hopper.MIN_SCORES set to `value` inside, e.g. 0 to force the Hopper kernels onto short problems."""
    saved = flash_hopper.MIN_SCORES
    flash_hopper.MIN_SCORES = value
    try:
        yield
    finally:
        flash_hopper.MIN_SCORES = saved


def host_us(run, calls: int = 20, reps: int = 5) -> float:
    per_call = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms: the queue never drains while the host works
        t = time.perf_counter()
        for _ in range(calls):
            run()
        per_call.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def fwd_bwd(name):
        attn = get_attention(name)

        def run():
            q.grad = k.grad = v.grad = None
            attn(q, k, v, causal=True).backward(do)
        return run

    cases = {"flash (triton)": fwd_bwd("flash"), "sdpa-cudnn": fwd_bwd("sdpa-cudnn")}
    def hopper():
        with forced_min_scores(0):
            fwd_bwd("flash")()
    cases["flash (hopper)"] = hopper
    for run in cases.values():
        for _ in range(5):
            run()
    torch.cuda.synchronize()
    for trial in range(2):
        for name, run in cases.items():
            bench = triton.testing.do_bench(run, warmup=25, rep=200)
            print(f"trial {trial} {name:16s} do_bench {bench:.3f} ms | gpu {gpu_ms(run):.3f} ms | "
                  f"host {host_us(run):.0f} us/call")
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    prof.enable()
    for _ in range(20):
        hopper()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
