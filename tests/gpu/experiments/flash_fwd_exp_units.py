"""Experiment: is the d-64 forward bound by the exp unit (MUFU)? Three ways to take P = exp2(x) in the same pointer
kernel (contiguous inputs, seq a multiple of the tiles, d_head a power of two), against flash and SDPA cuDNN on the
same inputs, do_bench medians:
  EXP=0  tl.exp2 on fp32, one MUFU op per score (what flash does);
  EXP=1  ex2.approx.f16x2 through inline PTX: the argument rounded to fp16, two scores per MUFU instruction;
  EXP=2  the key tile split in two halves: MUFU exp2 on one, a degree-3 polynomial on the FMA units on the other
         (Cody-Waite range reduction with the 1.5*2^23 rounding trick, the exponent added to the float's bits).
  EXP=3  MUFU exp2 with lazy rescaling (FlashAttention-4): the running max, hence acc and l, is only rescaled when
         some row's max grew by more than 8 in log2 units, so p <= 256; fewer FP32 instructions per tile.
If the forward is exp-bound, 1 and 2 run faster than 0; the error column is the max |O - O_sdpa|.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_fwd_exp_units.py"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from attention import flash_triton as ft


@triton.jit
def _exp2_f16x2(x):
    # x <= 0 (scores minus the running max), so its fp16 rounding error is at most 2^-11 relative.
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                     is_pure=True, pack=2).to(tl.float32)


@triton.jit
def _exp2_poly(x):
    # 2^x = 2^j * 2^f with j = round(x), f in [-0.5, 0.5]; 2^f by a cubic (rel. error ~1e-4, below bf16's 4e-3).
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2^23: the float's low mantissa bits now hold round(x)
    j = t - 12582912.0
    f = x - j
    p = 1.0 + f * (0.6931472 + f * (0.2402265 + f * 0.0555041))
    jbits = t.to(tl.int32, bitcast=True) - 0x4B400000  # round(x) as an integer
    return (p.to(tl.int32, bitcast=True) + (jbits << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _loop(acc, l_i, m_i, q, K, V, offs_m, lo, hi, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
          MASK: tl.constexpr, EXP: tl.constexpr):
    offs_d = tl.arange(0, D)
    if EXP == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        offs_h = tl.arange(0, HALF)
        for start_n in range(lo, hi, BLOCK_N):
            ka = tl.load(K + (start_n + offs_h)[:, None] * D + offs_d[None, :])
            kb = tl.load(K + (start_n + HALF + offs_h)[:, None] * D + offs_d[None, :])
            sa = tl.dot(q, tl.trans(ka))
            sb = tl.dot(q, tl.trans(kb))
            if MASK:
                sa = tl.where((start_n + offs_h)[None, :] <= offs_m[:, None], sa, float("-inf"))
                sb = tl.where((start_n + HALF + offs_h)[None, :] <= offs_m[:, None], sb, float("-inf"))
            m_new = tl.maximum(m_i, tl.maximum(tl.max(sa, 1), tl.max(sb, 1)) * qk_scale)
            pa = tl.exp2(sa * qk_scale - m_new[:, None])
            pb = _exp2_poly(sb * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(pa, 1) + tl.sum(pb, 1)
            va = tl.load(V + (start_n + offs_h)[:, None] * D + offs_d[None, :])
            vb = tl.load(V + (start_n + HALF + offs_h)[:, None] * D + offs_d[None, :])
            acc = acc * alpha[:, None]
            acc = tl.dot(pa.to(va.dtype), va, acc)
            acc = tl.dot(pb.to(vb.dtype), vb, acc)
            m_i = m_new
    else:
        offs_n = tl.arange(0, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            k = tl.load(K + (start_n + offs_n)[:, None] * D + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            if MASK:
                s = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if EXP == 3:
                # Lazy rescaling: keep the stale max unless some row's max grew by more than 2^8 (so p <= 256).
                if tl.max(m_new - m_i, 0) > 8.0:
                    alpha = tl.exp2(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                p = tl.exp2(s * qk_scale - m_i[:, None])
                l_i = l_i + tl.sum(p, 1)
                v = tl.load(V + (start_n + offs_n)[:, None] * D + offs_d[None, :])
                acc = tl.dot(p.to(v.dtype), v, acc)
            else:
                if EXP == 1:
                    p = _exp2_f16x2(s * qk_scale - m_new[:, None])
                else:
                    p = tl.exp2(s * qk_scale - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + (start_n + offs_n)[:, None] * D + offs_d[None, :])
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_exp(Q, K, V, O, N, qk_scale, D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, EXP: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * N * D
    Q += base
    K += base
    V += base
    O += base
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, K, V, offs_m, 0, pid_m * BLOCK_M, qk_scale, D, BLOCK_N, False, EXP)
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, K, V, offs_m, pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M, qk_scale,
                              D, BLOCK_N, True, EXP)
    else:
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, K, V, offs_m, 0, N, qk_scale, D, BLOCK_N, False, EXP)
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


def run(q, k, v, causal, bm, bn, warps, stages, exp):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    fwd_exp[(n // bm, b * h)](q, k, v, o, n, d ** -0.5 * 1.4426950408889634, D=d, CAUSAL=causal, BLOCK_M=bm,
                              BLOCK_N=bn, EXP=exp, num_warps=warps, num_stages=stages)
    return o


EXPS = (0, 1, 2, 3)


def main():
    shapes = [(1, 16, 16384, 64, True), (2, 16, 8192, 64, False), (2, 16, 8192, 128, True)]
    configs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2)]
    for b, h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            ms_cudnn = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=50, rep=300)
        scale = d ** -0.5
        o_ours = ft.flash_forward(q, k, v, causal, scale)[0]
        ms_ours = do_bench(lambda: ft.flash_forward(q, k, v, causal, scale), warmup=50, rep=300)
        err_ours = (o_ours.float() - ref.float()).abs().max().item()
        print(f"\n{(b, h, n, d, causal)}: cudnn {ms_cudnn:.3f} ms {flops / ms_cudnn / 1e9:.0f} TF/s | flash "
              f"{ms_ours:.3f} ms {flops / ms_ours / 1e9:.0f} TF/s err {err_ours:.1e}", flush=True)
        for bm, bn, warps, stages in configs:
            for exp in EXPS:
                try:
                    o = run(q, k, v, causal, bm, bn, warps, stages, exp)
                    err = (o.float() - ref.float()).abs().max().item()
                    ms = do_bench(lambda: run(q, k, v, causal, bm, bn, warps, stages, exp), warmup=30, rep=200)
                    print(f"  EXP={exp} {bm}x{bn} w{warps} s{stages}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s "
                          f"err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  EXP={exp} {bm}x{bn} w{warps} s{stages}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)


if __name__ == "__main__":
    main()
