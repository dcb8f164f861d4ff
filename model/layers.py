"""Building blocks: Linear and Embedding with the project's init, RMSNorm, SwiGLU, RoPE."""

from __future__ import annotations

import math
from typing import Optional

import einx
import torch
from torch import nn


class _LowPrecisionLinear(torch.autograd.Function):
    """x W^T in a low dtype (bf16 or fp16) with the weight gradient accumulated and written in fp32 by its matmul.

    Autocast's linear returns dW in the low dtype, and autograd then casts it to the fp32 parameter: a rounding of
    dW to 8 mantissa bits (bf16) and a cast kernel per weight. Here the matmul writes fp32 (`torch.mm(out_dtype=)`,
    CUDA): on the H100 the five Linears of a `large` block ran 4.9% less GPU time, with dW 600x closer to fp64.
    Forward and dX are autocast's: the same low-dtype matmuls. `weight_copy`, when given, is the weight already in
    `dtype` (Linear.keep_weight_copy), read instead of casting the weight again.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
                weight_copy: Optional[torch.Tensor] = None) -> torch.Tensor:
        x_low, w_low = x.to(dtype), (weight.to(dtype) if weight_copy is None else weight_copy)
        ctx.save_for_backward(x_low, w_low)
        ctx.x_dtype = x.dtype
        return nn.functional.linear(x_low, w_low)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_low, w_low = ctx.saved_tensors
        # Compiled, the backward is traced under the forward's autocast, which would run the CPU fallback's fp32
        # matmul in the low dtype again.
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(w_low.dtype)
            grad_x = (grad @ w_low).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            grad_2d, x_2d = grad.flatten(0, -2).t(), x_low.flatten(0, -2)  # (d_out, tokens), (tokens, d_in)
            if grad.is_cuda:
                grad_w = torch.mm(grad_2d, x_2d, out_dtype=torch.float32)
            else:  # mm has no out_dtype kernel on the CPU; products of low-dtype values are exact in fp32
                grad_w = torch.mm(grad_2d.float(), x_2d.float())
        return grad_x, grad_w, None, None


class Linear(nn.Module):
    """y = x W^T, no bias; W ~ truncated normal, std sqrt(2 / (d_in + d_out)), cut at +-3 std.

    fp32_weight_grad: under bf16/fp16 autocast with an fp32 weight, dW comes out of its matmul in fp32
    (_LowPrecisionLinear); otherwise, and always without autocast, this is F.linear.
    """

    def __init__(self, d_in: int, d_out: int, fp32_weight_grad: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.fp32_weight_grad = fp32_weight_grad
        self.weight_copy: Optional[torch.Tensor] = None  # keep_weight_copy's
        self.reset_parameters()

    def keep_weight_copy(self, dtype: torch.dtype) -> torch.Tensor:
        """A `dtype` copy of the weight that the autocast forward of that dtype reads instead of casting the weight
        in each call; returned for the optimizer, which must rewrite it whenever it updates the weight
        (training/adamw.py). Loading a state dict into this layer (or a module holding it) refreshes it."""
        if not (self.fp32_weight_grad and self.weight.dtype == torch.float32):
            raise ValueError("a weight copy is read by the fp32-weight-gradient path only: this layer has "
                             f"fp32_weight_grad={self.fp32_weight_grad} and a {self.weight.dtype} weight")
        self.weight_copy = self.weight.detach().to(dtype)
        if not hasattr(self, "_copy_refresh"):
            self._copy_refresh = self.register_load_state_dict_post_hook(Linear._refresh_weight_copy)
        return self.weight_copy

    @staticmethod
    @torch.no_grad()
    def _refresh_weight_copy(module: "Linear", incompatible_keys) -> None:
        if module.weight_copy is not None:
            module.weight_copy.copy_(module.weight)

    def reset_parameters(self) -> None:
        std = math.sqrt(2.0 / (self.weight.shape[0] + self.weight.shape[1]))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if self.fp32_weight_grad and self.weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            if dtype in (torch.bfloat16, torch.float16):
                copy = self.weight_copy if self.weight_copy is not None and self.weight_copy.dtype == dtype else None
                return _LowPrecisionLinear.apply(x, self.weight, dtype, copy)
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[1]}, d_out={self.weight.shape[0]}"


class Embedding(nn.Module):
    """Token id -> vector; weights N(0, 1) cut at +-3."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in fp32, returned in x's dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int, fp32_weight_grad: bool = True):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, fp32_weight_grad)
        self.w2 = Linear(d_ff, d_model, fp32_weight_grad)
        self.w3 = Linear(d_model, d_ff, fp32_weight_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[2i], x[2i+1]) of q and k by angle pos * theta^(-2i/d_head), for positions < max_seq_len.

    The cos/sin tables are computed once, at construction, as non-persistent buffers (they follow the model's
    device and stay out of checkpoints). Compiled code then loads them: computing them inside the compiled block
    instead made Inductor evaluate pow and cos per element of q and k: 12 of the 76 GPU ms of a `large` training
    step on the H100 went to those kernels (bench_model --profile).
    """

    def __init__(self, d_head: int, theta: float = 10_000.0, max_seq_len: int = 2048):
        super().__init__()
        if d_head % 2:
            raise ValueError(f"RoPE needs an even d_head, got {d_head}")
        self.d_head, self.theta, self.max_seq_len = d_head, theta, max_seq_len
        # In fp64, then rounded to fp32: angles of late positions keep their precision.
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (max_seq_len, d_head / 2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, seq_dim: int = -2) -> torch.Tensor:
        """x: (..., seq, d_head), or seq at `seq_dim` < -2, e.g. -3 for (batch, seq, heads, d_head);
        positions: (seq,) ints below max_seq_len, default 0..seq-1."""
        if seq_dim > -2:
            raise ValueError(f"seq_dim must be -2 or further left (counted from d_head = -1), got {seq_dim}")
        seq = x.shape[seq_dim]
        if positions is None:
            cos, sin = self.angles(seq)
        else:
            if not torch.compiler.is_compiling() and int(positions.max()) >= self.max_seq_len:
                raise ValueError(f"RoPE tables cover positions < {self.max_seq_len}; got {int(positions.max())}")
            cos, sin = self.cos[positions], self.sin[positions]
        # (seq, half) -> (seq, 1, ..., half): broadcast over the dims between seq and d_head.
        cos, sin = (t.view(seq, *[1] * (-seq_dim - 2), t.shape[-1]) for t in (cos, sin))
        return self.rotate(x, cos, sin)

    def angles(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0 .. seq - 1, (seq, d_head / 2) each."""
        if seq > self.max_seq_len:
            raise ValueError(f"RoPE tables cover {self.max_seq_len} positions; got a sequence of {seq}")
        return self.cos[:seq], self.sin[:seq]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., d_head) rotated by angles whose cos and sin (..., d_head / 2) broadcast against it."""
        x1, x2 = einx.id("... (half two) -> two ... half", x.float(), two=2)
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos))
        return einx.id("two ... half -> ... (half two)", rotated).to(x.dtype)
