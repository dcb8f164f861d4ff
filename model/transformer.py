"""The language model: embedding -> pre-norm blocks -> RMSNorm -> LM head."""

from __future__ import annotations

from typing import Optional

import einx
import torch
import torch.nn.functional as F
from torch import nn

from attention import get_attention
from model.config import ModelConfig
from model.fused_rope import split_heads, split_rotate
from model.kv_cache import KVCache, LayerCache
from model.layers import Embedding, Linear, ReLUSquared, RMSNorm, RotaryEmbedding, SwiGLU, rms_normalized


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k; the kernel comes from the registry.

    With n_kv_heads < n_heads (GQA) the fused projection is (q: heads, k: kv heads, v: kv heads) * d_head wide, and
    the backend gets k and v with their kv heads (never repeated). window: this layer's sliding window, or None;
    attn: the attention backend's name in the registry. With cfg.qk_norm each head's q and k are RMS-normalised;
    without a gain that commutes with RoPE's rotation (a rotation keeps the norm), so it is applied after it.
    """

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, window: Optional[int] = None, attn: str = "sdpa"):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * cfg.kv_heads * cfg.d_head)
        self.out = Linear(cfg.d_model, cfg.d_model)
        self.rope = rope
        self.qk_norm = cfg.qk_norm
        self.attn_name = attn
        self.attend = get_attention(attn)
        # Only the variants in use reach the backend, so a plain model runs on every backend.
        self.variant = {name: value for name, value in (("window", window), ("softcap", cfg.attn_softcap))
                        if value is not None}

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None, doc_ids: Optional[torch.Tensor] = None,
                rope_angles: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """doc_ids (batch, seq): packed documents, attended separately; rope_angles: (cos, sin) of each position
        (batch, seq, d_head / 2), for positions that restart at each document."""
        qkv = self.qkv(x)  # (batch, seq, (heads + 2 kv_heads) * d_head)
        if cache is not None:  # sampling: RoPE at the cached positions, and the backend's decode attention
            q, k, v = split_heads(qkv, self.n_heads, self.n_kv_heads)
            q, k = self.normalized(q, k)
            return self.out(cache.attend(q, k, v, self.rope, self.attend, self.variant))
        # q, k and v get storage of their own in (batch, seq, heads, d_head) order, seen by the backend as (batch,
        # heads, seq, d_head) views. Own storage: v saved for backward as a view would keep the whole projection
        # alive. That order: attention outputs follow q's memory order (cuDNN and flash), so "b s (h d)" below is a
        # view, not a second copy of o beside the one the backend saves.
        cos, sin = rope_angles or self.rope.angles(x.shape[1])  # ([batch,] seq, d_head / 2)
        q, k, v = split_rotate(qkv, self.n_heads, self.n_kv_heads, cos, sin)
        q, k = self.normalized(q, k)
        q, k, v = (einx.id("b s h d -> b h s d", t) for t in (q, k, v))
        if doc_ids is None:
            o = self.attend(q, k, v, causal=True, **self.variant)
        else:
            o = self.attend(q, k, v, causal=True, doc_ids=doc_ids, **self.variant)
        return self.out(einx.id("b h s d -> b s (h d)", o))

    def normalized(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (..., d_head), RMS-normalised over d_head (in fp32, returned in their dtype) under qk_norm."""
        if not self.qk_norm:
            return q, k
        return tuple(rms_normalized(t.float()).to(t.dtype) for t in (q, k))  # type: ignore[return-value]


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); the MLP is SwiGLU or ReLU² (cfg.mlp)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer: int = 0, attn: str = "sdpa"):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, rope, cfg.layer_window(layer), attn)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff) if cfg.mlp == "swiglu" else ReLUSquared(cfg.d_model, cfg.d_ff)
        if cfg.zero_init_residual:
            nn.init.zeros_(self.attn.out.weight)
            nn.init.zeros_(self.ffn.w2.weight)

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None, doc_ids: Optional[torch.Tensor] = None,
                rope_angles: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, doc_ids, rope_angles)
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    """The LM of `cfg`, its attention computed by the registry's backend `attn` (how it runs, not what it is)."""

    def __init__(self, cfg: ModelConfig, attn: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.d_head, cfg.rope_theta, cfg.context_length)  # one pair of tables for all layers
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, rope, i, attn) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)

    @property
    def attn(self) -> str:
        """The attention backend the blocks call."""
        return self.blocks[0].attn.attn_name

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None,
                cache: Optional[KVCache] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids: (batch, seq) int64 -> logits (batch, seq, vocab), or the mean loss on targets (batch, seq).

        cache: sampling (model/generation.py); ids are then the tokens after those already in the cache.
        doc_ids: (batch, seq) non-decreasing ints, packed documents (training/data/sampling.py): attention stays within a
        document, and RoPE positions restart at 0 where each document starts."""
        if ids.shape[-1] > self.cfg.context_length:
            raise ValueError(f"sequence of {ids.shape[-1]} tokens exceeds context_length {self.cfg.context_length}")
        x = self.embed(ids)
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # The residual stream in autocast's dtype, as in a model with bf16 weights: half the bytes for each
            # residual add and RMSNorm, with the same loss (results/README.md, design choices).
            x = x.to(torch.get_autocast_dtype(device))
        if doc_ids is not None:
            angles = self.document_rope_angles(doc_ids)
            for block in self.blocks:
                x = block(x, None, doc_ids, angles)
            return self.loss_from_hidden(x, targets) if targets is not None else self.logits(x)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache.layer(i))
        if targets is not None:
            return self.loss_from_hidden(x, targets)
        return self.logits(x)

    def document_rope_angles(self, doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), (batch, seq, d_head / 2): RoPE at each position's offset within its document."""
        rope = self.blocks[0].attn.rope
        doc_ids = doc_ids.contiguous()
        start = torch.searchsorted(doc_ids, doc_ids, side="left")  # where each position's document begins
        positions = torch.arange(doc_ids.shape[-1], device=doc_ids.device) - start  # < seq <= context_length
        return rope.cos[positions], rope.sin[positions]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, vocab) logits of the last hidden states x: (batch, seq, d_model); soft-capped in fp32 (or
        wider) under cfg.logit_softcap."""
        logits = self.lm_head(self.final_norm(x))
        cap = self.cfg.logit_softcap
        if cap is None:
            return logits
        return cap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cap)

    def loss_from_hidden(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32 scalar) of the last hidden states x: (batch, seq, d_model)."""
        logits = self.logits(x).float()  # fp32 softmax also under bf16 autocast
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding drops the token embedding (the LM head stays: it is a matmul)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n
