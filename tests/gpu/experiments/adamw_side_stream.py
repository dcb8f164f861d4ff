"""Experiment: how much of a `large` step's AdamW hides behind the backward if each block's parameters step on a
second CUDA stream as soon as their gradients exist (PyTorch's optimizer-in-backward recipe, on a side stream)?

The backward is emulated as in weight_grad_side_stream.py (the matmuls and elementwise traffic of 36 `large` blocks,
4096 tokens, in backward order), with fp32 weights, gradients and AdamW moments for every block's five Linears.
Replayed as CUDA graphs, median of 20:
  serial  the backward, then one fused AdamW over all parameters (torch.optim.AdamW(fused=True)), as now;
  side    after each block's dW, that block's fused AdamW on a second stream; the streams join at the end.
Parameters end bitwise equal either way (checked). Usage: PYTHONPATH=. python3 tests/gpu/experiments/adamw_side_stream.py
"""

from __future__ import annotations

import torch

from tests.gpu.experiments.weight_grad_side_stream import replay_ms

T, D, F, LAYERS = 4096, 1280, 5120, 36
BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = {"qkv": (3 * D, D), "out": (D, D), "w1": (F, D), "w3": (F, D), "w2": (D, F)}


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


class Layer:
    def __init__(self):
        self.w = {n: rand(*s) for n, s in SHAPES.items()}
        self.p = {n: torch.nn.Parameter(rand(*s, dtype=FP32) * 0.02) for n, s in SHAPES.items()}
        for p in self.p.values():
            p.grad = torch.zeros_like(p)
        self.x_in = {"qkv": rand(T, D), "out": rand(T, D), "w1": rand(T, D), "w3": rand(T, D), "w2": rand(T, F)}
        self.a1, self.a3 = rand(T, F), rand(T, F)
        self.resid = rand(T, D, dtype=FP32)
        self.opt = None


def layer_backward(layer: Layer, g: torch.Tensor) -> torch.Tensor:
    def lin(name, grad):
        torch.mm(grad.t(), layer.x_in[name], out_dtype=FP32, out=layer.p[name].grad)
        return grad @ layer.w[name]

    d2 = lin("w2", g)
    s = torch.sigmoid(layer.a1)
    da1 = (d2 * layer.a3 * s * (1 + layer.a1 * (1 - s))).to(BF16)
    da3 = (d2 * layer.a1 * s).to(BF16)
    dx = lin("w1", da1).float() + lin("w3", da3).float()
    do = lin("out", (layer.resid + dx).to(BF16))
    dx = lin("qkv", torch.cat([do, do * 0.5, do * 0.25], dim=1)).float()
    return (layer.resid + dx).to(BF16)


def step(layers, g, whole_opt, side):
    main = torch.cuda.current_stream()
    for layer in reversed(layers):
        g = layer_backward(layer, g)
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                layer.opt.step()
    if side is None:
        whole_opt.step()
    else:
        main.wait_stream(side)


def make_opts(layers):
    lr = torch.tensor(1e-4, device="cuda")
    for layer in layers:
        layer.opt = torch.optim.AdamW(list(layer.p.values()), lr=lr, fused=True, capturable=True)
    return torch.optim.AdamW([p for l in layers for p in l.p.values()], lr=lr, fused=True, capturable=True)


def main() -> None:
    torch.manual_seed(0)
    layers = [Layer() for _ in range(LAYERS)]
    g = rand(T, D)
    whole = make_opts(layers)
    side = torch.cuda.Stream()
    for trial in range(2):
        serial = replay_ms(lambda: step(layers, g, whole, None))
        overlapped = replay_ms(lambda: step(layers, g, whole, side))
        print(f"trial {trial}: serial {serial:.2f} ms | side {overlapped:.2f} ms ({overlapped / serial:.3f}, "
              f"{serial - overlapped:.2f} ms less)")
    # Same start, one step each way: the parameters must agree bitwise.
    torch.manual_seed(1)
    small = [Layer() for _ in range(2)]
    start = [{n: p.detach().clone() for n, p in l.p.items()} for l in small]
    whole = make_opts(small)
    step(small, g, whole, None)
    after_serial = [{n: p.detach().clone() for n, p in l.p.items()} for l in small]
    for l, s in zip(small, start):
        for n, p in l.p.items():
            p.data.copy_(s[n])
    make_opts(small)
    step(small, g, None, side)
    torch.cuda.synchronize()
    print("bitwise equal:", all(torch.equal(l.p[n], a[n]) for l, a in zip(small, after_serial) for n in SHAPES))


if __name__ == "__main__":
    main()
