"""flash's Hopper backward, fused (dQ added with TMA reductions) against deterministic (dK/dV and dQ kernels side by
side) and SDPA's cuDNN: `check` compares each to float64, `time` times forward+backward and the backward alone
(do_bench medians, the Hopper kernels at every size). python scripts/backward_modes_bench.py [check|time]"""
import math, sys, time
import torch
import torch.nn.functional as F
from triton.testing import do_bench
from attention.flash import choose_kernels
from attention.flash.api import flash_attention
from torch.nn.attention import sdpa_kernel, SDPBackend

torch.manual_seed(0)
dev = "cuda"

def ref(q, k, v, causal, window=None):
    qd, kd, vd = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        mask &= i[:, None] >= i[None, :]
    if window:
        mask &= (i[:, None] - i[None, :]) < window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vd

def grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
from attention.flash.hopper import inputs as hopper_inputs
hopper_inputs.MIN_SCORES = 0  # the Hopper kernels at every size
if mode in ("all", "check"):
    print("== correctness: max |err| vs float64, fused / deterministic")
    for (b, h, kv, n, d, causal, window) in [(2, 4, 4, 1024, 128, True, None), (2, 4, 4, 1024, 64, True, None),
                                             (1, 8, 2, 2048, 128, True, None), (1, 4, 4, 768, 128, False, None),
                                             (1, 8, 4, 1024, 64, True, 300), (3, 2, 1, 512, 128, True, None)]:
        q = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, kv, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kv, n, d, device=dev, dtype=torch.bfloat16)
        do = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        od = ref(qd, kd, vd, causal, window)
        od.backward(do.double())
        refs = (od, qd.grad, kd.grad, vd.grad)
        sc = d ** -0.5
        choice = choose_kernels(q, k, v, causal, window=window, deterministic=False)
        out = {}
        for det in (False, True):
            out[det] = grads(lambda a, b_, c: flash_attention(a, b_, c, causal, sc, window=window, deterministic=det), q, k, v, do)
        errs = {det: [(x.double() - r).abs().max().item() for x, r in zip(out[det], refs)] for det in out}
        again = grads(lambda a, b_, c: flash_attention(a, b_, c, causal, sc, window=window, deterministic=True), q, k, v, do)
        bitwise = all(torch.equal(a, b_) for a, b_ in zip(again, out[True]))
        ok = all(ef <= 2 * ed + 1e-2 for ef, ed in zip(errs[False], errs[True]))
        print(f"B{b} H{h} KV{kv} N{n} D{d} causal={causal} window={window}: {choice.backward_reason[-60:]}")
        print("   fused", " ".join(f"{e:.2e}" for e in errs[False]), "| det", " ".join(f"{e:.2e}" for e in errs[True]),
              "| det bitwise", bitwise, "| OK" if ok else "| BAD")

if mode in ("all", "time"):
    print("== timings (ms): bwd only and fwd+bwd; fused, deterministic, cuDNN")
    shapes = [(1, 16, 16, 16384, 64, True), (1, 16, 16, 4096, 64, True), (16, 12, 12, 1024, 64, True),
              (4, 20, 20, 1024, 64, True), (2, 16, 16, 8192, 128, True), (8, 16, 16, 2048, 128, True),
              (1, 32, 32, 32768, 128, True), (8, 16, 4, 4096, 128, True), (1, 64, 8, 8192, 128, True),
              (2, 16, 16, 8192, 64, False), (2, 16, 16, 8192, 128, False)]
    from attention.registry import graph_replay
    for (b, h, kv, n, d, causal) in shapes:
        q = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, kv, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, kv, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
        sc = d ** -0.5
        res = {}
        def fb(fn):
            def run():
                o = fn()
                o.backward(do)
            return run
        for name, det in (("fused", False), ("det", True)):
            if True:
                f = lambda: flash_attention(q, k, v, causal, sc, deterministic=det)
                fwd = do_bench(f, warmup=20, rep=150)
                tot = do_bench(fb(f), warmup=20, rep=150, grad_to_none=[q, k, v])
            res[name] = (tot, tot - fwd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            g = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv != h)
            fwd = do_bench(g, warmup=20, rep=150)
            tot = do_bench(fb(g), warmup=20, rep=150, grad_to_none=[q, k, v])
            res["cudnn"] = (tot, tot - fwd)
        flops = 4 * b * h * n * n * d / (2 if causal else 1) * 2.5
        print(f"B{b} H{h} KV{kv} N{n} D{d} {'causal' if causal else 'full'}: " +
              " ".join(f"{k_}: {t:.3f}/{bw:.3f}" for k_, (t, bw) in res.items()) +
              f" | cudnn/fused fwd+bwd {res['cudnn'][0] / res['fused'][0]:.3f} bwd {res['cudnn'][1] / res['fused'][1]:.3f}"
              f" | det fwd+bwd {res['cudnn'][0] / res['det'][0]:.3f} | fused bwd TF/s {flops / res['fused'][1] / 1e9:.0f}", flush=True)
