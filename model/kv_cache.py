"""A static key/value cache for sampling: preallocated once, written in place, fixed shapes at every step.

`KVCache` holds the keys and values of every layer for `batch` sequences of up to `max_len` tokens (one
(batch, heads, max_len, d_head) buffer each per layer, in the dtype the model computes in) and `lengths`, the tokens
cached per sequence; with GQA, heads are the model's key/value heads. Nothing is reallocated or resized while
sampling, so a decode step has the same shapes and addresses every time and can be compiled and captured in a CUDA
graph (the design of gpt-fast). Buffers of their own per layer, not views of one (layers, ...) buffer: a compiled
step that writes into views of a shared buffer copies the whole buffer back; one written in place is updated where it
lies.

The model takes the cache through `TransformerLM.forward(ids, cache=...)`; each attention layer hands its q, k, v
to `LayerCache.attend`:
- the first call on an empty cache (the prefill) writes positions 0..seq-1 of every sequence and runs the backend's
  ordinary causal attention over the prompt, the ops of training. Prompts of different lengths are right-padded:
  a padded position sees only what precedes it and is overwritten by the first decode steps.
- later calls (decode steps) write the new tokens at each sequence's own `lengths[b]` and run the backend's decode
  attention over the first `lengths[b] + n_new` positions.
The caller advances `lengths` (model/generation.py); the model never changes it.
"""

from __future__ import annotations

from typing import Optional

import einx
import torch
from torch import nn

from model.config import ModelConfig
from model.layers import RotaryEmbedding


class KVCache(nn.Module):
    """Keys, values and per-sequence lengths; buffers, so they follow .to() and count as static for compilation."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: Optional[torch.device | str] = None):
        super().__init__()
        if not 1 <= max_len <= cfg.context_length:
            raise ValueError(f"max_len must be in 1..context_length ({cfg.context_length}), got {max_len}")
        shape = (batch, cfg.kv_heads, max_len, cfg.d_head)
        for i in range(cfg.n_layers):  # k0, v0, k1, ...: (batch, heads, max_len, d_head)
            for name in ("k", "v"):
                self.register_buffer(f"{name}{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch, dtype=torch.int64, device=device), persistent=False)
        self.batch, self.max_len = batch, max_len
        # Whether the prefill has run: a Python bool, so compiled code specialises on it (prefill and decode are
        # two graphs) and no step reads a device value on the host.
        self.filled = False

    def reset(self) -> None:
        """Empty the cache for new prompts (the memory is kept)."""
        self.lengths.zero_()
        self.filled = False

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    def keys_values(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (k, v) buffers, (batch, heads, max_len, d_head) each."""
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    @property
    def dtype(self) -> torch.dtype:
        return self.k0.dtype


class LayerCache:
    """The view of one layer; `attend` is what CausalSelfAttention calls instead of its training path."""

    def __init__(self, cache: KVCache, index: int):
        self.cache = cache
        self.k, self.v = cache.keys_values(index)  # (batch, heads, max_len, d_head)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RotaryEmbedding,
               attention, variant: Optional[dict] = None) -> torch.Tensor:
        """q: (batch, n_new, heads, d_head), k, v: (batch, n_new, kv heads, d_head), before RoPE -> (batch, n_new,
        heads * d_head). variant: the layer's window and softcap, as its training attention takes them."""
        variant = variant or {}
        n_new = q.shape[1]
        if not self.cache.filled:
            # The prefill: positions 0..n_new-1 of every sequence, attention as in training.
            q, k = rope(q, seq_dim=-3), rope(k, seq_dim=-3)
            self.k[:, :, :n_new] = einx.id("b s h d -> b h s d", k)
            self.v[:, :, :n_new] = einx.id("b s h d -> b h s d", v)
            q, k, v = (einx.id("b s h d -> b h s d", t.contiguous()) for t in (q, k, v))
            o = attention(q, k, v, causal=True, **variant)
        else:
            positions = self.cache.lengths[:, None] + torch.arange(n_new, device=q.device)  # (batch, n_new)
            # RoPE tables gathered at each sequence's own positions; max_len <= context_length keeps them in range.
            cos, sin = rope.cos[positions][:, :, None], rope.sin[positions][:, :, None]  # (batch, n_new, 1, half)
            q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
            rows = torch.arange(q.shape[0], device=q.device)[:, None]
            # Advanced indices (rows, positions) around a slice: the written block is (batch, n_new, heads, d_head).
            self.k[rows, :, positions] = k
            self.v[rows, :, positions] = v
            o = attention.decode(einx.id("b s h d -> b h s d", q), self.k, self.v, positions[:, -1] + 1, **variant)
        return einx.id("b h s d -> b s (h d)", o)
