"""Experiment: does a different way of writing RoPE let Inductor make its kernels faster?

The `large` step's profile (results/README.md, tenth session) put RoPE's compiled kernels at 27 us forward and 42 us
backward per layer, 55-65% of their memory floor. model.layers.RotaryEmbedding splits each head into (x[2i],
x[2i+1]) pairs, rotates them and stacks them back. The alternative here is purely elementwise: out = x * C + x' * S,
where x' swaps each pair (x'[2i] = x[2i+1], x'[2i+1] = x[2i]) and C, S are the cos and (-sin, sin) tables
interleaved to the head's width. Both run as the attention block does: q, k, v taken from the fused projection
(batch, seq, 3 * d_model), q and k rotated, all three made contiguous; forward and backward compiled, captured
in a CUDA graph, replays timed with do_bench. Usage: PYTHONPATH=. python3 tests/gpu/experiments/rope_formulations.py
Outcome on the H100 (results/README.md, eleventh session): 11% faster here, no faster in the whole graphed step, so
model.layers keeps the pairs.
"""

from __future__ import annotations

import einx
import torch
import triton

from benchmarking.timing import captured
from model.layers import RotaryEmbedding

B, T, H, D = 4, 1024, 20, 64  # the `large` model's attention input


class InterleavedTablesRoPE(torch.nn.Module):
    def __init__(self, rope: RotaryEmbedding):
        super().__init__()
        self.register_buffer("c", rope.cos.repeat_interleave(2, dim=-1))  # (max_seq, d)
        self.register_buffer("s", torch.stack((-rope.sin, rope.sin), dim=-1).flatten(-2))

    def forward(self, x: torch.Tensor, seq_dim: int = -3) -> torch.Tensor:
        seq = x.shape[seq_dim]
        c, s = (t[:seq].view(seq, *[1] * (-seq_dim - 2), t.shape[-1]) for t in (self.c, self.s))
        x32 = x.float()
        swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return (x32 * c + swapped * s).to(x.dtype)


def block_inputs(rope, qkv):
    q, k, v = einx.id("b s (three h d) -> three b s h d", qkv, three=3, h=H)
    return rope(q, seq_dim=-3).contiguous(), rope(k, seq_dim=-3).contiguous(), v.contiguous()


def main() -> None:
    torch.manual_seed(0)
    base = RotaryEmbedding(D, max_seq_len=T).cuda()
    variants = {"pairs (model.layers)": base, "interleaved tables": InterleavedTablesRoPE(base).cuda()}
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    outs = {}
    for name, rope in variants.items():
        fn = torch.compile(lambda x, rope=rope: block_inputs(rope, x))

        def fwd_bwd(fn=fn):
            outs_ = fn(qkv)
            torch.autograd.backward(outs_, grads)

        for _ in range(3):
            qkv.grad = None
            fwd_bwd()
        qkv.grad = None
        with torch.no_grad():
            outs[name] = [t.clone() for t in fn(qkv)]
        fwd_bwd()
        outs[name].append(qkv.grad.clone())
        fwd = captured(lambda fn=fn: fn(qkv), "cuda")
        both = captured(fwd_bwd, "cuda", grad_to_none=[qkv])
        print(f"{name:22s} forward {triton.testing.do_bench(fwd):.4f} ms | forward+backward "
              f"{triton.testing.do_bench(both):.4f} ms")
    a, b = outs.values()
    for label, x, y in zip(("q", "k", "v", "dqkv"), a, b):
        print(f"max |difference| {label}: {(x.float() - y.float()).abs().max().item():.3e}")
    floor_fwd = 2 * 3 * B * T * H * D * 2 / 3.0e12 * 1e3  # read and write q, k, v in bf16 at 3.0 TB/s
    print(f"memory floor at 3.0 TB/s: forward {floor_fwd:.4f} ms, forward+backward {2 * floor_fwd:.4f} ms")


if __name__ == "__main__":
    main()
