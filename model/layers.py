"""Building blocks: Linear and Embedding with the project's init, RMSNorm, SwiGLU, RoPE."""

from __future__ import annotations

import math

import einx
import torch
from torch import nn


class Linear(nn.Module):
    """y = x W^T, no bias; W ~ truncated normal, std sqrt(2 / (d_in + d_out)), cut at +-3 std."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(2.0 / (self.weight.shape[0] + self.weight.shape[1]))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[2i], x[2i+1]) of q and k by angle pos * theta^(-2i/d_head)."""

    def __init__(self, d_head: int, theta: float = 10_000.0):
        super().__init__()
        if d_head % 2:
            raise ValueError(f"RoPE needs an even d_head, got {d_head}")
        self.d_head = d_head
        self.theta = theta
        self._tables: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (seq_len, d_head / 2) in fp32, cached per device and length."""
        if torch.compiler.is_compiling():  # computed in the graph: reading the cache would recompile once it fills
            return self.compute_tables(seq_len, device)
        key = (device, seq_len)
        if key not in self._tables:
            self._tables[key] = self.compute_tables(seq_len, device)
        return self._tables[key]

    def compute_tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the angles, computed in fp64 and rounded to fp32."""
        inv_freq = self.theta ** (-torch.arange(0, self.d_head, 2, device=device, dtype=torch.float64) / self.d_head)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., seq, d_head); positions: (seq,) ints, default 0..seq-1."""
        seq = x.shape[-2]
        cos, sin = self.tables(seq if positions is None else int(positions.max()) + 1, x.device)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        else:
            cos, sin = cos[:seq], sin[:seq]
        x1, x2 = einx.id("... s (half two) -> two ... s half", x.float(), two=2)
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos))
        return einx.id("two ... s half -> ... s (half two)", rotated).to(x.dtype)
