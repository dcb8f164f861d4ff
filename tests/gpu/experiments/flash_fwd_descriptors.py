"""Experiment, kept as the record of a negative result (results/README.md): a forward kernel that loads through
on-device tensor descriptors (TMA) with optional warp specialisation, against flash's pointer kernel (autotuned)
and SDPA cuDNN on the same inputs, do_bench medians. Contiguous inputs with seq a multiple of the tile only.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_fwd_descriptors.py"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from attention import flash_triton as ft


@triton.jit
def _band(acc, l_i, m_i, q, dk, dv, base, offs_m, lo, hi, qk_scale,
          BLOCK_N: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = dk.load([base + start_n, 0])
        s = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([base + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_desc(Q, K, V, O, L, ROWS, N, qk_scale, D: tl.constexpr, CAUSAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    dq = tl.make_tensor_descriptor(Q, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    dk = tl.make_tensor_descriptor(K, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    dv = tl.make_tensor_descriptor(V, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    do = tl.make_tensor_descriptor(O, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    base = bh * N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = dq.load([base + pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        acc, l_i, m_i = _band(acc, l_i, m_i, q, dk, dv, base, offs_m, 0, pid_m * BLOCK_M, qk_scale, BLOCK_N, False, WS)
        acc, l_i, m_i = _band(acc, l_i, m_i, q, dk, dv, base, offs_m, pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M,
                              qk_scale, BLOCK_N, True, False)
    else:
        acc, l_i, m_i = _band(acc, l_i, m_i, q, dk, dv, base, offs_m, 0, N, qk_scale, BLOCK_N, False, WS)
    o = acc / l_i[:, None]
    do.store([base + pid_m * BLOCK_M, 0], o.to(do.dtype))
    tl.store(L + bh.to(tl.int64) * N + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453)


def run_desc(q, k, v, causal, bm, bn, warps, stages, ws):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    fwd_desc[(n // bm, b * h)](q, k, v, o, lse, b * h * n, n, d ** -0.5 * 1.4426950408889634, D=d, CAUSAL=causal,
                               BLOCK_M=bm, BLOCK_N=bn, WS=ws, num_warps=warps, num_stages=stages)
    return o


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    shapes = [(1, 16, 16384, 64, True), (1, 16, 4096, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False)]
    configs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 4), (128, 32, 4, 4),
               (256, 64, 8, 3), (256, 128, 16, 2), (128, 128, 4, 2)]
    for b, h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            ms_cudnn = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=50, rep=300)
        scale = d ** -0.5
        ft.flash_forward(q, k, v, causal, scale)
        ms_ours = do_bench(lambda: ft.flash_forward(q, k, v, causal, scale), warmup=50, rep=300)
        key = ("fwd", n, n, d, causal, q.dtype, q.device)
        print(f"\n{(b, h, n, d, causal)}: cudnn {ms_cudnn:.3f} ms {flops / ms_cudnn / 1e9:.0f} TF/s | ours(ptr) "
              f"{ms_ours:.3f} ms {flops / ms_ours / 1e9:.0f} TF/s tuned {ft._tuned.get(key)}", flush=True)
        for ws in (False, True):
            for bm, bn, warps, stages in configs:
                try:
                    o = run_desc(q, k, v, causal, bm, bn, warps, stages, ws)
                    err = (o.float() - ref.float()).abs().max().item()
                    ms = do_bench(lambda: run_desc(q, k, v, causal, bm, bn, warps, stages, ws), warmup=30, rep=200)
                    print(f"  desc ws={ws:d} {bm}x{bn} w{warps} s{stages}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s "
                          f"err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  desc ws={ws:d} {bm}x{bn} w{warps} s{stages}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)


if __name__ == "__main__":
    main()
