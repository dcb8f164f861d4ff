"""Experiment: where the host time of flash's Hopper path goes, piece by piece, at B1 H16 N4096 D64 causal (bf16).

Each piece is timed alone with calls queued behind a sleeping GPU (host_us), so the figures are host time only:
the autograd round trip of an empty Function, one allocation, a TMA descriptor, one kernel launch through Triton's
JIT and one through the compiled kernel directly, the Hopper forward and backward host functions, and the whole
forward+backward through the registry (flash on its Hopper kernels, flash as dispatched, cuDNN).
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_host_pieces.py
"""

from __future__ import annotations

import math

import torch
import triton

from attention import flash_hopper, flash_triton, get_attention
from tests.gpu.experiments.short_sequence_host_vs_gpu import forced_min_scores, host_us
from tests.gpu.flash_host_breakdown import Nothing

B, H, N, D = 1, 16, 4096, 64


def main() -> None:
    from attention.flash_hopper_kernels import attn_fwd_hopper

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o = torch.empty_like(qd)
    lse = torch.empty(B * H, N, device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(D)
    t = flash_hopper.tiles_for(D, N, B * H, torch.cuda.get_device_properties(0).multi_processor_count)
    q_desc, q_index = flash_hopper._descriptor(qd, t.block_m)
    k_desc, k_index = flash_hopper._descriptor(kd, t.block_n)
    v_desc, v_index = flash_hopper._descriptor(vd, t.block_n)
    o_desc, _ = flash_hopper._descriptor(o, t.block_m)
    grid = (triton.cdiv(N, t.rows), B * H)
    jit_args = (q_desc, k_desc, v_desc, o_desc, lse, *q_index, *k_index, *v_index, H, N, scale * math.log2(math.e))
    meta = flash_hopper._meta(t, True)
    compiled = attn_fwd_hopper[grid](*jit_args, **meta)
    consts = {name: meta[name] for name in attn_fwd_hopper.arg_names if name in meta}
    direct_args = (*jit_args, *consts.values())  # the constexprs are the signature's last parameters
    stream = torch.cuda.current_stream().cuda_stream
    runner = compiled[(grid[0], grid[1], 1)]
    delta = torch.empty_like(lse)
    dq, dk, dv = (torch.empty_like(x) for x in (qd, kd, vd))

    def fwd_bwd(name, min_scores=None):
        attn = get_attention(name)

        def run():
            with forced_min_scores(flash_hopper.MIN_SCORES if min_scores is None else min_scores):
                q.grad = k.grad = v.grad = None
                attn(q, k, v, causal=True).backward(do)
        return run

    def empty_fn():
        q.grad = k.grad = v.grad = None
        Nothing.apply(q, k, v).backward(do)

    pieces = {
        "autograd: empty Function fwd+bwd (4 allocations)": empty_fn,
        "torch.empty_like": lambda: torch.empty_like(qd),
        "flash_hopper._descriptor (view + from_tensor)": lambda: flash_hopper._descriptor(qd, 64),
        "forward_problem": lambda: flash_hopper.forward_problem(qd, kd, vd, True),
        "backward_problem": lambda: flash_hopper.backward_problem(qd, kd, vd, do, True),
        "forward kernel launch, JIT": lambda: attn_fwd_hopper[grid](*jit_args, **meta),
        "forward kernel launch, compiled[grid](...)": lambda: runner(*direct_args, stream=stream),
        "flash_hopper.forward (4 descriptors + launch)": lambda: flash_hopper.forward(qd, kd, vd, o, lse, True, scale),
        "flash_triton._delta (Triton launch)": lambda: flash_triton._delta(o, do),
        "flash_hopper.backward (13 descriptors, 2 launches, streams)":
            lambda: flash_hopper.backward(qd, kd, vd, do, lse, delta, dq, dk, dv, True, scale),
        "fwd+bwd: flash on the Hopper kernels": fwd_bwd("flash", min_scores=0),
        "fwd+bwd: flash as dispatched (Triton kernels)": fwd_bwd("flash"),
        "fwd+bwd: sdpa-cudnn": fwd_bwd("sdpa-cudnn"),
    }
    hopper_fwd_bwd = pieces["fwd+bwd: flash on the Hopper kernels"]

    def forward_only():
        with forced_min_scores(0):
            get_attention("flash")(q, k, v, causal=True)

    def backward_direct():
        with forced_min_scores(0):
            flash_triton.flash_backward(qd, kd, vd, o, lse.view(B, H, N), do, True, scale)

    pieces["forward only: flash on the Hopper kernels"] = forward_only
    pieces["flash_triton.flash_backward, main thread, Hopper kernels"] = backward_direct
    for run in pieces.values():
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    print(f"{'piece':62s} host us/call (two trials)")
    for name, run in pieces.items():
        print(f"{name:62s} {host_us(run):8.1f} {host_us(run):8.1f}")
    inclusive_times(hopper_fwd_bwd)


def inclusive_times(run, calls: int = 20) -> None:
    """Wall time inside each host function of the Hopper path during `calls` forward+backward calls, on whichever
    thread it runs (cProfile sees only the main thread; autograd runs the backward on its own)."""
    import functools
    import time
    from collections import defaultdict

    totals: dict[str, float] = defaultdict(float)
    targets = [(flash_triton, n) for n in ("flash_forward", "flash_backward", "_hopper_forward", "_hopper_backward",
                                           "_delta", "_check")]
    targets += [(flash_hopper, n) for n in ("forward", "backward", "backward_dkdv", "backward_dq", "_descriptor",
                                            "forward_problem", "backward_problem")]
    targets += [(flash_triton.FlashAttentionTriton, n) for n in ("forward", "backward")]
    originals = []
    for owner, name in targets:
        fn = owner.__dict__[name]
        inner = fn.__func__ if isinstance(fn, staticmethod) else fn

        def timed(*a, _inner=inner, _name=f"{owner.__name__}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                totals[_name] += time.perf_counter() - t
        originals.append((owner, name, fn))
        setattr(owner, name, staticmethod(timed) if isinstance(fn, staticmethod) else functools.wraps(inner)(timed))
    try:
        run()
        totals.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)
        t = time.perf_counter()
        for _ in range(calls):
            run()
        whole = time.perf_counter() - t
        torch.cuda.synchronize()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    print(f"\ninclusive host us per forward+backward (Hopper kernels), {calls} calls behind a sleeping GPU")
    print(f"{'whole call':50s} {whole / calls * 1e6:8.1f}")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:50s} {total / calls * 1e6:8.1f}")


if __name__ == "__main__":
    main()
