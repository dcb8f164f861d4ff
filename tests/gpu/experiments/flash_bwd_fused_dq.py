"""Experiment: a deterministic backward with 5 tile matmuls instead of 7.

flash's backward runs a dK/dV kernel (4 matmuls per tile pair) and a separate dQ kernel (3, recomputing P and dP),
so that no two programs add into the same dQ rows. Here the dK/dV kernel also computes dQ's share, dS @ K (the 5th
matmul), and adds it into an fp32 dQ buffer. The additions to each query tile are ordered by semaphores, always
from the highest key tile down, so the sum, hence dQ, is bitwise the same on every run:
  - programs launch in descending key-tile order and only wait for the program of the next higher key tile, which
    launched earlier, so every program waited on is running or done: no deadlock;
  - causal: program j starts at its diagonal query tile, where program j+1 already was one tile earlier, so in the
    steady state nobody waits;
  - the first contributor to a tile stores without reading; the last (key tile 0) writes dQ in the input dtype.
ordered=False adds with fp32 atomics in any order instead (not deterministic): the cost of the 5-matmul kernel
without the ordering. Contiguous (batch, heads, seq, d) inputs, seq a multiple of BLOCK_N, d a power of two. Compared with flash's
backward and SDPA cuDNN's on the same inputs (do_bench medians), and checked bitwise against itself.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_bwd_fused_dq.py"""

import math
import os

import torch
import triton
import triton.language as tl

from attention import flash_triton as ft


@triton.jit
def bwd_fused(Q, K, V, DO, L, DELTA, DK, DV, DQ, DQ_ACC, SEM, N, qk_scale, scale,
              D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              ORDERED: tl.constexpr):
    n_kv = tl.num_programs(0)
    j = n_kv - 1 - tl.program_id(0)  # highest key tile first (see the module docstring)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * N * D
    Q += base
    K += base
    V += base
    DO += base
    DK += base
    DV += base
    DQ += base
    DQ_ACC += base
    L += bh * N
    DELTA += bh * N
    n_q = N // BLOCK_M
    SEM += bh * n_q

    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])
    v = tl.load(V + offs_n[:, None] * D + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    i_lo = 0
    if CAUSAL:
        i_lo = j * (BLOCK_N // BLOCK_M)
    for i in range(i_lo, n_q):
        rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :])
        do = tl.load(DO + rows[:, None] * D + offs_d[None, :])
        lse2 = tl.load(L + rows) * 1.4426950408889634
        delta = tl.load(DELTA + rows)
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # (BLOCK_N, BLOCK_M)
        if CAUSAL:
            p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        ds_t16 = ds_t.to(q.dtype)
        dk = tl.dot(ds_t16, q, dk)
        dq = tl.dot(tl.trans(ds_t16), k)  # this key tile's share of dQ for query tile i, (BLOCK_M, D) fp32
        # Contributors to query tile i: key tiles 0..last, added from last down to 0.
        last = n_kv - 1
        if CAUSAL:
            last = tl.minimum(n_kv - 1, ((i + 1) * BLOCK_M - 1) // BLOCK_N)
        acc_ptrs = DQ_ACC + rows[:, None] * D + offs_d[None, :]
        if ORDERED:
            if j < last:
                while tl.atomic_add(SEM + i, 0, sem="acquire") != last - j:
                    pass
                dq += tl.load(acc_ptrs, cache_modifier=".cg")  # from L2: another SM wrote it
            if j > 0:
                tl.store(acc_ptrs, dq)
                tl.debug_barrier()  # every thread's part is stored before the release
                tl.atomic_add(SEM + i, 1, sem="release")
            else:
                tl.store(DQ + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))
        else:  # the cost floor without the order: fp32 atomics, any order (not deterministic)
            tl.atomic_add(acc_ptrs, dq, sem="relaxed")
    tl.store(DK + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty))


def fused_backward(q, k, v, o, lse, do, causal, scale, bm, bn, warps, stages, ordered=True):
    b, h, n, d = q.shape
    delta = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    ft._kernels().attn_bwd_delta[(triton.cdiv(n, ft.DELTA_BLOCK_M), b * h)](
        o, do, delta, *o.stride(), *do.stride(), h, n, D=d, BLOCK_D=d, BLOCK_M=ft.DELTA_BLOCK_M)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_acc = (torch.empty if ordered else torch.zeros)(q.shape, device=q.device, dtype=torch.float32)
    sem = torch.zeros(b * h * (n // bm), device=q.device, dtype=torch.int32)
    bwd_fused[(n // bn, b * h)](q, k, v, do, lse, delta, dk, dv, dq, dq_acc, sem, n, scale * math.log2(math.e),
                                scale, D=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                num_stages=stages, ORDERED=ordered)
    if not ordered:
        dq = (dq_acc * scale).to(q.dtype)
    return dq, dk, dv


def check_cpu():
    """Interpreter check against flash's backward (fp32, small): python tests/gpu/experiments/... with
    TRITON_INTERPRET=1 and CHECK_CPU=1."""
    for causal in (True, False):
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(2, 2, 64, 32, generator=g) for _ in range(4))
        scale = 32 ** -0.5
        o, lse = ft.flash_forward(q, k, v, causal, scale)
        ref = ft.flash_backward(q, k, v, o, lse, do, causal, scale)
        for ordered in (True, False):
            ours = fused_backward(q, k, v, o, lse, do, causal, scale, 16, 32, 4, 1, ordered)
            print(causal, ordered, [f"{(a - b).abs().max().item():.1e}" for a, b in zip(ours, ref)])


def main():
    from triton.testing import do_bench

    shapes = [(1, 16, 16384, 64, True), (2, 16, 8192, 64, False), (2, 16, 8192, 128, True)]
    configs = [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2)]
    for b, h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d ** -0.5
        o, lse = ft.flash_forward(q, k, v, causal, scale)
        ref = ft.flash_backward(q, k, v, o, lse, do, causal, scale)
        ms_ours = do_bench(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale), warmup=30, rep=200)
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            ms_cudnn = do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True),
                                warmup=30, rep=200)
        print(f"\n{(b, h, n, d, causal)}: backward ms: flash {ms_ours:.3f}, cuDNN {ms_cudnn:.3f}", flush=True)
        for (bm, bn, warps, stages), ordered in ((c, o_) for c in configs for o_ in (True, False)):
            try:
                got = fused_backward(q, k, v, o, lse, do, causal, scale, bm, bn, warps, stages, ordered)
                again = fused_backward(q, k, v, o, lse, do, causal, scale, bm, bn, warps, stages, ordered)
                same = all(torch.equal(a, c) for a, c in zip(got, again))
                err = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
                ms = do_bench(lambda: fused_backward(q, k, v, o, lse, do, causal, scale, bm, bn, warps, stages,
                                                     ordered), warmup=30, rep=200)
                print(f"  fused {'ordered' if ordered else 'atomic '} {bm}x{bn} w{warps} s{stages}: {ms:.3f} ms, max |diff| vs flash {err:.1e}, "
                      f"bitwise repeatable {same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  fused {bm}x{bn} w{warps} s{stages}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)


if __name__ == "__main__":
    check_cpu() if os.environ.get("CHECK_CPU") else main()
