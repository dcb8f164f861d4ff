"""Experiment: what would weight gradients written in fp32 by the matmul itself buy a `large` training step?

Under bf16 autocast a Linear's weight gradient leaves its matmul in bf16, and a separate kernel casts it to the
fp32 of the parameter. `torch.mm(..., out_dtype=torch.float32)` (CUDA) writes fp32 from the matmul instead. Each of
the five Linears of a `large` block (4096 tokens: qkv, out, w1, w3, w2), forward + backward compiled as a block
would be, GPU time (median of 30; see gpu_ms), weight.grad reset to None before each run as in the training step:
  autocast  F.linear under torch.autocast (what model/layers.py does);
  fp32-dW   an autograd Function: W cast to bf16 in forward, dX = dY W in bf16, dW = mm(dY^T, X, out_dtype=fp32).
Errors are max |dW - dW_fp64| / max |dW_fp64|. Usage: PYTHONPATH=. python3 tests/gpu/experiments/linear_fp32_weight_grad.py
"""

import statistics

import torch
import torch.nn.functional as F

TOKENS, D, F_FF, LAYERS = 4096, 1280, 5120, 36  # `large` at batch 4, context 1024
SHAPES = {"qkv": (D, 3 * D), "out": (D, D), "w1": (D, F_FF), "w3": (D, F_FF), "w2": (F_FF, D)}


def gpu_ms(run, reps: int = 30) -> float:
    """GPU time of run(), without its host time: a sleep kernel holds the GPU while the host enqueues the run, so
    the events time its kernels back to back. (A one-Linear run launches ~1 ms of host work for ~0.1 ms of GPU work;
    a CUDA-graph capture of the backward failed, as autograd runs it on another thread.)"""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms at the H100's clock: far longer than the host needs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class LinearFp32WeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        w16 = weight.to(torch.bfloat16)
        x16 = x.to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype = x.dtype
        return x16 @ w16.t()

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        grad_x = (grad @ w16).to(ctx.x_dtype)
        grad_w = torch.mm(grad.flatten(0, -2).t(), x16.flatten(0, -2), out_dtype=torch.float32)
        return grad_x, grad_w


def autocast_linear(x, w):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return F.linear(x, w)


def fp32_dw_linear(x, w):
    with torch.autocast("cuda", enabled=False):
        return LinearFp32WeightGrad.apply(x, w)


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"{'linear':>6} {'autocast ms':>12} {'fp32-dW ms':>11} {'saved ms':>9} {'err autocast':>13} {'err fp32-dW':>12}")
    total = {"autocast": 0.0, "fp32-dW": 0.0}
    for name, (d_in, d_out) in SHAPES.items():
        x = torch.randn(TOKENS, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(d_out, d_in, device="cuda") / d_in**0.5).requires_grad_()
        dy = torch.randn(TOKENS, d_out, device="cuda", dtype=torch.bfloat16)
        want = (dy.double().t() @ x.double())
        ms, err = {}, {}
        for label, fn in (("autocast", autocast_linear), ("fp32-dW", fp32_dw_linear)):
            step = torch.compile(lambda: fn(x, w).backward(dy), dynamic=False)

            def run():
                w.grad, x.grad = None, None
                step()

            run()
            assert w.grad.dtype == torch.float32
            err[label] = ((w.grad.double() - want).abs().max() / want.abs().max()).item()
            ms[label] = gpu_ms(run)
            total[label] += ms[label]
        print(f"{name:>6} {ms['autocast']:12.4f} {ms['fp32-dW']:11.4f} {ms['autocast'] - ms['fp32-dW']:9.4f} "
              f"{err['autocast']:13.2e} {err['fp32-dW']:12.2e}")
    saved = total["autocast"] - total["fp32-dW"]
    print(f"per block: autocast {total['autocast']:.3f} ms, fp32-dW {total['fp32-dW']:.3f} ms; "
          f"x {LAYERS} layers: {saved * LAYERS:.2f} ms per step saved")


if __name__ == "__main__":
    main()
