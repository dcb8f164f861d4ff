"""Is flash at short sequences bound by host time or by its kernels? For each shape and backend: the median
fwd+bwd time (do_bench), the host time per call (calls queued without synchronising, divided by the count)
and the GPU kernel time per call (torch.profiler's CUDA totals). Usage: python3 tests/gpu/flash_host_vs_gpu.py"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from attention import get_attention

SHAPES = [(1, 16, 4096, 64), (4, 20, 1024, 64), (1, 16, 16384, 64)]  # N4096 peer shape, the large model, leaderboard
BACKENDS = ["flash", "sdpa-cudnn", "sdpa-flash"]


def fwd_bwd(attend, q, k, v, do):
    def run():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v, causal=True).backward(do)
    return run


def main() -> None:
    print(f"{'shape':>22} {'backend':>11} {'fwd+bwd ms':>11} {'host ms/call':>13} {'GPU ms/call':>12}  top kernels (ms/call)")
    for b, h, n, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for name in BACKENDS:
            run = fwd_bwd(get_attention(name), q, k, v, do)
            ms = do_bench(run, warmup=50, rep=200)
            calls = 50
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            host = (time.perf_counter() - start) / calls * 1e3  # queued, not finished: the host's own time
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    run()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            gpu = sum(e.device_time_total for e in events) / calls / 1e3
            top = sorted(events, key=lambda e: -e.device_time_total)[:3]
            tops = ", ".join(f"{e.key[:28]} {e.device_time_total / calls / 1e3:.3f}" for e in top)
            print(f"{str((b, h, n, d)):>22} {name:>11} {ms:11.3f} {host:13.3f} {gpu:12.3f}  {tops}", flush=True)


def profile_host(shape=(4, 20, 1024, 64), calls: int = 50) -> None:
    """cProfile of the host side of flash fwd+bwd calls: where the host time per call goes."""
    import cProfile
    import pstats

    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    run = fwd_bwd(get_attention("flash"), q, k, v, do)
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def compare_paths(shape=(4, 20, 1024, 64), calls: int = 100) -> None:
    """Host ms per fwd+bwd call through the eager registry and through FlashAttentionTriton.apply."""
    from attention.flash_triton import FlashAttentionTriton

    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    paths = {"registry": get_attention("flash"),
             "autograd.Function": lambda q, k, v, causal: FlashAttentionTriton.apply(q, k, v, causal)}
    for name, attend in paths.items():
        run = fwd_bwd(attend, q, k, v, do)
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        host = (time.perf_counter() - start) / calls * 1e3
        torch.cuda.synchronize()
        print(f"{str(shape):>22} {name:>18}: host {host:.3f} ms per fwd+bwd", flush=True)


if __name__ == "__main__":
    import sys

    if "--profile-host" in sys.argv:
        profile_host()
    elif "--paths" in sys.argv:
        compare_paths()
    else:
        main()
