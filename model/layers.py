"""Building blocks: Linear and Embedding with the project's init, RMSNorm, the MLPs (SwiGLU, ReLU²), RoPE."""

from __future__ import annotations

import math
from typing import Optional

import einx
import torch
from torch import nn

from model.fused_swiglu import silu_mul


class _LowPrecisionLinear(torch.autograd.Function):
    """x W^T in a low dtype (bf16 or fp16) with the weight gradient accumulated and written in fp32 by its matmul.

    Autocast's linear returns dW in the low dtype, which autograd then casts to the fp32 parameter: a rounding of dW
    to 8 mantissa bits (bf16) and a cast kernel per weight. Here the matmul writes fp32 (`torch.mm(out_dtype=)`),
    which is both faster and closer to fp64 (results/README.md, design choices). Forward and dX are autocast's.

    Several weights with the same d_in are one matmul against their concatenation (the output features of each in
    turn): one dX matmul and one dW matmul for all, dW split back into a view per weight. `weight_copy`, when given,
    is that (concatenated) weight already in `dtype` (Linear.keep_weight_copy), read instead of casting again.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, weight_copy: Optional[torch.Tensor],
                *weights: torch.Tensor) -> torch.Tensor:
        x_low = x.to(dtype)
        if weight_copy is not None:
            w_low = weight_copy
        else:
            w_low = weights[0].to(dtype) if len(weights) == 1 else torch.cat([w.to(dtype) for w in weights])
        ctx.save_for_backward(x_low, w_low)
        ctx.x_dtype, ctx.rows = x.dtype, [w.shape[0] for w in weights]
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
        return grad_x, None, None, *grad_w.split(ctx.rows)


def low_precision_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                         weight_copy: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x times the fp32 `weights` concatenated by output feature, (..., sum of d_out), in autocast's low dtype with
    fp32 weight gradients (_LowPrecisionLinear); None where that path does not apply (no bf16/fp16 autocast on x's
    device, or weights not fp32): the caller then runs the plain matmul."""
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and all(w.dtype == torch.float32 for w in weights)):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if weight_copy is not None and weight_copy.dtype != dtype:
        weight_copy = None
    return _LowPrecisionLinear.apply(x, dtype, weight_copy, *weights)


class Linear(nn.Module):
    """y = x W^T, no bias; W ~ truncated normal, std sqrt(2 / (d_in + d_out)), cut at +-3 std.

    Under bf16/fp16 autocast with an fp32 weight, dW comes out of its matmul in fp32 (_LowPrecisionLinear);
    otherwise this is F.linear.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.weight_copy: Optional[torch.Tensor] = None  # keep_weight_copy's
        self.reset_parameters()

    def keep_weight_copy(self, dtype: torch.dtype, storage: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A `dtype` copy of the weight that the autocast forward of that dtype reads instead of casting the weight
        in each call; returned for the optimizer, which must rewrite it whenever it updates the weight
        (training/optim/adamw_bf16.py). Loading a state dict into this layer (or a module holding it) refreshes it.
        storage: where the copy lives (the weight's shape, `dtype`), e.g. part of a tensor a fused matmul reads."""
        if self.weight.dtype != torch.float32:
            raise ValueError(f"a weight copy is read by the fp32-weight-gradient path only: this layer has a "
                             f"{self.weight.dtype} weight")
        if storage is None:
            self.weight_copy = self.weight.detach().to(dtype)
        elif storage.shape != self.weight.shape or storage.dtype != dtype:
            raise ValueError(f"a weight copy of {tuple(self.weight.shape)} in {dtype} cannot live in a "
                             f"{tuple(storage.shape)} {storage.dtype} tensor")
        else:
            self.weight_copy = storage.copy_(self.weight.detach())
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
        y = low_precision_linear(x, (self.weight,), self.weight_copy)
        return nn.functional.linear(x, self.weight) if y is None else y

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
        return (rms_normalized(x.float(), self.eps) * self.weight.float()).to(x.dtype)


def rms_normalized(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in x's dtype (callers pass fp32 for an fp32 result)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


class ReLUSquared(nn.Module):
    """w2(relu(w1 x)^2): two matrices where SwiGLU has three (So et al., "Primer", 2021; modded-nanogpt's MLP)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.relu(self.w1(x)).square())


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x).

    Under bf16/fp16 autocast w1 and w3 run as one matmul against their two weights concatenated, and so do their dX
    and dW matmuls; the parameters stay w1 and w3, each with its own (view of the) gradient. The one dX matmul also
    sums the two branches' input gradients in its accumulator rather than in a pass over both.
    """

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)
        self.gate_up_copy: Optional[torch.Tensor] = None  # keep_weight_copies': w1's and w3's copies, (2 d_ff, d_model)

    def keep_weight_copies(self, dtype: torch.dtype) -> dict[nn.Parameter, torch.Tensor]:
        """Linear.keep_weight_copy of w1, w2 and w3, {weight: copy}; those of w1 and w3 are the two halves of one
        tensor, which the fused matmul reads whole."""
        d_ff, d_model = self.w1.weight.shape
        both = torch.empty(2 * d_ff, d_model, dtype=dtype, device=self.w1.weight.device)
        copies = {self.w1.weight: self.w1.keep_weight_copy(dtype, both[:d_ff]),
                  self.w3.weight: self.w3.keep_weight_copy(dtype, both[d_ff:]),
                  self.w2.weight: self.w2.keep_weight_copy(dtype)}
        self.gate_up_copy = both
        return copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._gate_up(x)
        if gate_up is None:
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        return self.w2(silu_mul(gate_up))

    def _gate_up(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """(w1 x, w3 x) side by side, (..., 2 d_ff), from one matmul; None where the two run apart (no low-precision
        autocast, or layers replaced, as by float8 training)."""
        w1, w3 = self.w1, self.w3
        if not (type(w1) is Linear and type(w3) is Linear):
            return None
        return low_precision_linear(x, (w1.weight, w3.weight), self.gate_up_copy)


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[2i], x[2i+1]) of q and k by angle pos * theta^(-2i/d_head), for positions < max_seq_len.

    The cos/sin tables are computed once, at construction, as non-persistent buffers (they follow the model's
    device and stay out of checkpoints). Compiled code then loads them; computed inside a compiled block, Inductor
    would evaluate pow and cos per element of q and k.
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
