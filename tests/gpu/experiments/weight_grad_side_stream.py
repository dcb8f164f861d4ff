"""Experiment: would weight-gradient matmuls on a second CUDA stream shorten a `large` backward?

The dW matmuls of a `large` step run at about 620 TFLOP/s against 734 for the forward and dX ones
(tests/gpu/kernel_categories.py on the profile): w1, w2 and w3 give 200 output tiles of 256x128 on 132 SMs, so their
second wave runs half empty. dW and dX of one Linear do not depend on each other. This replays, as CUDA graphs, the
backward's matmuls and its elementwise traffic for 36 blocks of `large` (4096 tokens), in the backward's order:
  serial     everything on one stream, as now;
  side       each dW on a second stream, joined once at the end;
  side+prio  the same, the first stream at high priority (the dX chain is the critical path);
  per-linear each Linear's dW on the second stream beside its own dX, joined before the next Linear (what one
             operator per Linear backward can do without handing unfinished tensors to autograd).
Attention is left out: the question is how much of the dW time hides behind the rest.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/weight_grad_side_stream.py
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

T, D, F, LAYERS = 4096, 1280, 5120, 36
BF16, FP32 = torch.bfloat16, torch.float32


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


class Layer:
    def __init__(self):
        self.w = {"qkv": rand(3 * D, D), "out": rand(D, D), "w1": rand(F, D), "w3": rand(F, D), "w2": rand(D, F)}
        self.x_in = {"qkv": rand(T, D), "out": rand(T, D), "w1": rand(T, D), "w3": rand(T, D), "w2": rand(T, F)}
        self.a1, self.a3 = rand(T, F), rand(T, F)
        self.resid = rand(T, D, dtype=FP32)


def backward(layers: list[Layer], g: torch.Tensor, dw_stream: torch.cuda.Stream | None,
             join_each: bool = False) -> list[torch.Tensor]:
    main = torch.cuda.current_stream()
    grads = []

    def linear_backward(name: str, layer: Layer, grad: torch.Tensor) -> torch.Tensor:
        if dw_stream is None:
            grads.append(torch.mm(grad.t(), layer.x_in[name], out_dtype=FP32))
        else:
            dw_stream.wait_stream(main)
            with torch.cuda.stream(dw_stream):
                grads.append(torch.mm(grad.t(), layer.x_in[name], out_dtype=FP32))
        dx = grad @ layer.w[name]
        if join_each and dw_stream is not None:
            main.wait_stream(dw_stream)
        return dx

    for layer in reversed(layers):
        d2 = linear_backward("w2", layer, g)  # (T, F)
        s = torch.sigmoid(layer.a1)  # silu * mul backward: the same bytes as the fused kernel
        da1 = (d2 * layer.a3 * s * (1 + layer.a1 * (1 - s))).to(BF16)
        da3 = (d2 * layer.a1 * s).to(BF16)
        dx = linear_backward("w1", layer, da1).float() + linear_backward("w3", layer, da3).float()
        resid = layer.resid + dx  # RMSNorm backward's traffic, roughly
        do = linear_backward("out", layer, resid.to(BF16))
        dqkv = torch.cat([do, do * 0.5, do * 0.25], dim=1)  # RoPE backward's traffic, roughly
        dx = linear_backward("qkv", layer, dqkv).float()
        g = (layer.resid + dx).to(BF16)
    if dw_stream is not None:
        main.wait_stream(dw_stream)
    return grads


def replay_ms(run: Callable[[], object], priority: int = 0, reps: int = 20) -> float:
    """Median GPU ms of run() captured once as a CUDA graph (on a stream of the given priority) and replayed."""
    stream = torch.cuda.Stream(priority=priority)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    layers = [Layer() for _ in range(LAYERS)]
    g = rand(T, D)
    side = torch.cuda.Stream()
    for trial in range(2):
        serial = replay_ms(lambda: backward(layers, g, None))
        overlapped = replay_ms(lambda: backward(layers, g, side))
        low = torch.cuda.Stream(priority=0)
        prio = replay_ms(lambda: backward(layers, g, low), priority=-1)
        each = replay_ms(lambda: backward(layers, g, side, join_each=True))
        print(f"trial {trial}: serial {serial:.2f} ms | side {overlapped:.2f} ms ({overlapped / serial:.3f}) | "
              f"side+prio {prio:.2f} ms ({prio / serial:.3f}) | per-linear {each:.2f} ms ({each / serial:.3f})")
    ref = backward(layers[:1], g, None)
    got = backward(layers[:1], g, side)
    torch.cuda.synchronize()
    print("dW bitwise equal:", all(torch.equal(a, b) for a, b in zip(ref, got)))


if __name__ == "__main__":
    main()
