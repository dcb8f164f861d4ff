"""Where does flash's host time per call go? Host microseconds per call (calls queued without synchronising) for
each layer of the eager path, from a bare Triton launch up to forward+backward through the registry, with SDPA
and a do-nothing autograd.Function as references. Usage: PYTHONPATH=. python3 tests/gpu/flash_host_breakdown.py"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attention import flash_triton as ft
from attention import get_attention

SHAPE = (4, 20, 1024, 64)


@triton.jit
def _empty_kernel(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                  BLOCK: tl.constexpr):
    pass


class _FlashFwdOnly(torch.autograd.Function):
    """flash forward, empty backward: is the forward's host time different inside autograd?"""

    @staticmethod
    def forward(ctx, q, k, v):
        return ft.flash_forward(q, k, v, True, SHAPE[-1] ** -0.5)[0]

    @staticmethod
    def backward(ctx, do):
        return torch.empty_like(do), torch.empty_like(do), torch.empty_like(do)


class _FlashBwdOnly(torch.autograd.Function):
    """empty forward, flash backward (on saved tensors): the backward's host time on the autograd thread."""

    saved = None

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = _FlashBwdOnly.saved
        return ft.flash_backward(q, k, v, o, lse, do, True, SHAPE[-1] ** -0.5)


class Nothing(torch.autograd.Function):
    """Allocates its outputs and computes nothing: autograd's own host time per forward+backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return torch.empty_like(do), torch.empty_like(do), torch.empty_like(do)


def host_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    q, k, v, do = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    scale = SHAPE[-1] ** -0.5
    flash = get_attention("flash")

    # Capture the exact launch arguments of the forward kernel, to replay them bare.
    captured = {}
    real_launch = ft._launch

    def capture(kernel, seq_lens, bh, args, meta, like, tiles):
        captured.setdefault(kernel, (seq_lens[0], bh, args, meta))
        return real_launch(kernel, seq_lens, bh, args, meta, like, tiles)

    ft._launch = capture
    o, lse = ft.flash_forward(q.detach(), k.detach(), v.detach(), True, scale)
    ft.flash_backward(q.detach(), k.detach(), v.detach(), o, lse, do, True, scale)
    ft._launch = real_launch
    n_rows, bh, args, meta = captured["fwd"]
    tuner = ft._autotuned("fwd")
    best = tuner.best_config
    jit_fn = ft._kernels().attn_fwd
    grid = (triton.cdiv(n_rows, best.kwargs["BLOCK_M"]), bh)
    x = torch.empty(16, device="cuda")

    def fwd_bwd(attend):
        def run():
            for t in (q, k, v):
                t.grad = None
            attend(q, k, v).backward(do)
        return run

    rows = [
        ("empty triton kernel, 21 args", lambda: _empty_kernel[(1,)](x, *range(20), BLOCK=16)),
        ("torch.empty x2", lambda: (torch.empty(SHAPE, device="cuda"), torch.empty(SHAPE[:-1], device="cuda"))),
        ("torch.cuda.device(q.device) enter/exit", lambda: ft._on_device_of(q).__enter__()),
        ("validate + checks (_check)", lambda: ft._check(q, k, v, True, None)),
        ("fwd kernel: jit_fn[grid] tuned config", lambda: jit_fn[grid](*args, **meta, **best.all_kwargs())),
        ("fwd kernel: autotuner[grid]", lambda: tuner[lambda m: (triton.cdiv(n_rows, m["BLOCK_M"]), bh)](*args, **meta)),
        ("flash_forward (autotune)", lambda: ft.flash_forward(q.detach(), k.detach(), v.detach(), True, scale)),
        ("flash_backward (autotune)",
         lambda: ft.flash_backward(q.detach(), k.detach(), v.detach(), o, lse, do, True, scale)),
        ("do-nothing Function fwd+bwd", fwd_bwd(Nothing.apply)),
        ("FlashAttentionTriton fwd (no grad)",
         lambda: ft.FlashAttentionTriton.apply(q.detach(), k.detach(), v.detach(), True)),
        ("FlashAttentionTriton fwd+bwd", fwd_bwd(lambda q, k, v: ft.FlashAttentionTriton.apply(q, k, v, True))),
        ("registry flash fwd+bwd", fwd_bwd(lambda q, k, v: flash(q, k, v, causal=True))),
        ("custom op fwd+bwd", fwd_bwd(lambda q, k, v: ft.flash_opaque_op(q, k, v, True, scale, False)[0])),
        ("triton_op fwd+bwd, eager", fwd_bwd(lambda q, k, v: ft.flash_op(q, k, v, True, scale, False)[0])),
        ("Function: flash fwd, empty bwd", fwd_bwd(_FlashFwdOnly.apply)),
        ("Function: empty fwd, flash bwd", fwd_bwd(_FlashBwdOnly.apply)),
        ("sdpa fwd+bwd", fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))),
    ]
    _FlashBwdOnly.saved = (q.detach(), k.detach(), v.detach(), o, lse)
    print(f"shape {SHAPE} bf16 causal; tuned fwd config {best}")
    for name, fn in rows:
        print(f"{name:>42}: {host_us(fn):8.1f} us/call", flush=True)
    # Backward on the calling thread instead of the autograd engine's device thread.
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in rows[-5:]:
            print(f"{'(single-threaded) ' + name:>60}: {host_us(fn):8.1f} us/call", flush=True)

    run = fwd_bwd(lambda q, k, v: ft.FlashAttentionTriton.apply(q, k, v, True))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        run()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
