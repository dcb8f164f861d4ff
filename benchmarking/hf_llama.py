"""The peer for training-step benchmarks: Hugging Face `LlamaForCausalLM` built to one of our size presets.

Llama is the same architecture (RMSNorm, SwiGLU, RoPE, pre-norm blocks, untied head), so it times what a
user would otherwise train with. `bench_model.py --impl hf` runs it through the same step, optimizer and
timing as our model, on the same tokens, in the same process. transformers is optional: only this peer
needs it, and the error says how to install it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import hf_llama
from model.config import ModelConfig


def _llama_classes():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise RuntimeError("the Hugging Face peer (--impl hf) needs transformers: "
                           "pip install transformers (or .venv/bin/pip install -e '.[peers]')") from e
    return LlamaConfig, LlamaForCausalLM


class HFLlama(nn.Module):
    """LlamaForCausalLM with our model's call signature: forward(ids) -> logits, forward(ids, targets) -> loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        LlamaConfig, LlamaForCausalLM = _llama_classes()
        self.cfg = cfg
<<<<<<< HEAD
        self.hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.context_length, rope_theta=cfg.rope_theta, rms_norm_eps=1e-5,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_cache=False,
            attn_implementation="sdpa"))
=======
        # The same architecture as ours (model/hf_llama.py maps the config), GQA included.
        self.hf = LlamaForCausalLM(LlamaConfig(**hf_llama.llama_config(cfg), use_cache=False,
                                               attn_implementation="sdpa"))
>>>>>>> hf-interop

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=ids, use_cache=False).logits  # (batch, seq, vocab)
        if targets is None:
            return logits
        # As our model and as transformers' own loss: cross-entropy on fp32 logits.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.hf.model.embed_tokens.weight.numel() if non_embedding else n


def llama_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
<<<<<<< HEAD
    """Our TransformerLM's weights under LlamaForCausalLM's names, so both compute the same function.

    Our RoPE rotates the pairs (2i, 2i+1) of a head, Llama's `rotate_half` the pairs (i, i + d_head/2), at the same
    frequencies: the q and k rows of each head are reordered (even rows, then odd ones). q.k is unchanged by it.
    """
    cfg = model.cfg
    d_head = cfg.d_head
    within = torch.cat([torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)])
    rows = (torch.arange(cfg.n_heads)[:, None] * d_head + within).flatten().to(model.embed.weight.device)
    kv_rows = rows[:cfg.kv_heads * d_head]  # the same reordering of each of the key/value heads
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.final_norm.weight,
             "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.qkv.weight.split([cfg.d_model, cfg.kv_heads * d_head, cfg.kv_heads * d_head])
        prefix = f"model.layers.{i}."
        state.update({
            prefix + "input_layernorm.weight": block.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": q[rows],
            prefix + "self_attn.k_proj.weight": k[kv_rows],
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": block.attn.out.weight,
            prefix + "post_attention_layernorm.weight": block.ffn_norm.weight,
            prefix + "mlp.gate_proj.weight": block.ffn.w1.weight,
            prefix + "mlp.up_proj.weight": block.ffn.w3.weight,
            prefix + "mlp.down_proj.weight": block.ffn.w2.weight,
        })
    return {name: t.detach().clone() for name, t in state.items()}
=======
    """Our TransformerLM's weights under LlamaForCausalLM's names, so both compute the same function (copies: the
    mapping, with its RoPE row order, is model/hf_llama.py's)."""
    return {name: t.detach().clone() for name, t in hf_llama.to_llama(model.state_dict(), model.cfg).items()}
>>>>>>> hf-interop


def llama_from(model: nn.Module) -> HFLlama:
    """HFLlama with `model`'s weights, on its device and in its dtype (the peer of sampling benchmarks)."""
    param = next(model.parameters())
    with torch.device(param.device):
        peer = HFLlama(model.cfg)
    peer.hf.load_state_dict(llama_state_dict(model))
    return peer.to(param.dtype).eval().requires_grad_(False)
