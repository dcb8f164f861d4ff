"""Time flash's two backward modes against SDPA's cuDNN and FlashAttention-2 kernels, bf16, on a CUDA GPU.

For each shape, on the same inputs: forward+backward and backward alone (triton.testing.do_bench medians, after its
warm-up) of flash as dispatched (its default mode: the Hopper backward where it runs, else the fast one), flash's
Triton kernels in the fast mode (dK/dV adds dQ atomically) and in the deterministic mode (use_kernels("triton")),
SDPA cuDNN and SDPA FlashAttention-2. One table: ms, best SDPA / flash, backward TFLOP/s (2.5 * 4 * B * H * N^2 * D,
halved when causal). What it says decides FAST_BACKWARD_ON_HOPPER (attention/flash/dispatch.py).

    python scripts/backward_modes_bench.py [--shapes "1,16,16,16384,64,1 ..."] [--no-autotune]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention import flash_kernels, get_attention, use_kernels  # noqa: E402

# (batch, query heads, key/value heads, seq, d_head, causal)
SHAPES = [(1, 16, 16, 16384, 64, True), (1, 16, 16, 4096, 64, True), (16, 12, 12, 1024, 64, True),
          (4, 20, 20, 1024, 64, True), (2, 16, 16, 8192, 128, True), (8, 16, 16, 2048, 128, True),
          (1, 32, 32, 32768, 128, True), (8, 16, 4, 4096, 128, True), (1, 64, 8, 8192, 128, True),
          (2, 16, 16, 8192, 64, False)]
METHODS = ["flash", "triton-fast", "triton-det", "cudnn", "fa2"]


def attend(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    if method in ("cudnn", "fa2"):
        backend = SDPBackend.CUDNN_ATTENTION if method == "cudnn" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    flash = get_attention("flash")
    if method == "flash":
        return flash(q, k, v, causal=causal)
    with use_kernels("triton"):
        return flash(q, k, v, causal=causal, deterministic=method == "triton-det")


def times(method: str, q, k, v, do, causal: bool) -> tuple[float, float]:
    """(forward+backward ms, backward ms), do_bench medians."""
    inputs = (q, k, v)

    def step():
        torch.autograd.grad(attend(method, q, k, v, causal), inputs, do)

    # The backward asks use_kernels again: keep it inside for the Triton rows.
    with use_kernels("triton" if method.startswith("triton") else "auto"):
        both = do_bench(step, warmup=25, rep=100, return_mode="median")
        o = attend(method, q, k, v, causal)
        backward = do_bench(lambda: torch.autograd.grad(o, inputs, do, retain_graph=True), warmup=25, rep=100,
                            return_mode="median")
    return both, backward


def row(shape: tuple) -> str:
    b, h, h_kv, n, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(heads):
        return torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = make(h), make(h_kv), make(h_kv)
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    result = {}
    for method in METHODS:
        try:
            result[method] = times(method, q, k, v, do, causal)
        except RuntimeError as e:  # an SDPA kernel that refuses the shape (e.g. FA2 with GQA)
            result[method] = None
            print(f"  {method} at {shape}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    sdpa = [result[m] for m in ("cudnn", "fa2") if result[m]]
    best = (min(t[0] for t in sdpa), min(t[1] for t in sdpa)) if sdpa else None
    name = f"{'causal' if causal else 'full'} B{b} H{h}" + (f" KV{h_kv}" if h_kv != h else "") + f" N{n} D{d}"
    cells = [f"{name:<30}"]
    for m in METHODS:
        t = result[m]
        cells.append(f"{t[0]:7.3f} {t[1]:7.3f}" if t else f"{'n/a':>7} {'n/a':>7}")
    for m in ("flash", "triton-fast", "triton-det"):
        t = result[m]
        cells.append(f"{best[0] / t[0]:4.2f} {best[1] / t[1]:4.2f}" if t and best else " n/a  n/a")
    cells += [f"{flops / t[1] / 1e9:5.0f}" if t else "  n/a" for t in (result["flash"], result["triton-fast"],
                                                                      best)]
    choice = flash_kernels(q, k, v, causal=causal)
    return "  ".join(cells) + f"  bwd {choice.backward}/{choice.backward_mode}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="space-separated batch,heads,kv_heads,seq,d_head,causal(1/0) (default: the "
                                    "ten of SHAPES)")
    p.add_argument("--no-autotune", action="store_true", help="launch flash's default tiles (FLASH_ATTN_AUTOTUNE=0)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("backward_modes_bench.py needs a CUDA GPU")
    if args.no_autotune:
        os.environ["FLASH_ATTN_AUTOTUNE"] = "0"
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split()]
        shapes = [(*s[:5], bool(s[5])) for s in shapes]
    print(f"{torch.cuda.get_device_name()}, bf16; ms: fwd+bwd bwd; ratio = best SDPA / that flash (fwd+bwd bwd); "
          f"TFLOP/s of the backward")
    header = [f"{'shape':<30}", *[f"{m:>15}" for m in METHODS], *[f"{m[:9]:>9}" for m in METHODS[:3]],
              "  flash  t-fast  sdpa"]
    print("  ".join(header))
    for shape in shapes:
        print(row(shape), flush=True)


if __name__ == "__main__":
    main()
