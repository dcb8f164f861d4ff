"""The one mapping between our TransformerLM and Hugging Face's LlamaForCausalLM: parameter names and layouts, both
ways, and ModelConfig <-> a Llama `config.json`.

The two compute the same function (pre-norm blocks, RMSNorm, SwiGLU, RoPE, untied head) with three differences of
layout: our attention has one fused qkv projection (q: n_heads, k and v: n_kv_heads heads of d_head rows), Llama
three; SwiGLU's w1, w3, w2 are Llama's gate, up and down projections; and our RoPE rotates the pairs (2i, 2i+1) of a
head where Llama's `rotate_half` rotates (i, i + d_head/2), at the same frequencies. So each head's q and k rows
are reordered (the even rows, then the odd ones): q.k is unchanged by it, and the logits are the same.

Plain dicts and tensors only: transformers is not needed to convert, only to run the result.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from model.config import ModelConfig

NORM_EPS = 1e-5  # our RMSNorm's epsilon (model/layers.py)
ARCHITECTURE = "LlamaForCausalLM"

# Ours -> Llama's names of the weights that map one to one (the fused qkv splits in three).
_GLOBAL = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
_PER_LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn.out.weight": "self_attn.o_proj.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight", "ffn.w1.weight": "mlp.gate_proj.weight",
              "ffn.w3.weight": "mlp.up_proj.weight", "ffn.w2.weight": "mlp.down_proj.weight"}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
# Buffers some Llama checkpoints carry: recomputed from the config, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaConfigError(ValueError):
    """A Llama config (or state dict) our model cannot express; the one-line message names the key and value."""


def rope_rows(n_heads: int, d_head: int) -> torch.Tensor:
    """Row order of Llama's q (or k) projection in ours: llama_rows = our_rows[rope_rows(...)], per head."""
    within = torch.cat([torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)])
    return (torch.arange(n_heads)[:, None] * d_head + within).flatten()


def to_llama(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our TransformerLM state dict under LlamaForCausalLM's names and layout. Tensors that need no reordering are
    the same objects (no copy); the q/k rows and the qkv split are new tensors."""
    d_head, heads, kv = cfg.d_head, cfg.n_heads, cfg.kv_heads
    q_rows, k_rows = rope_rows(heads, d_head), rope_rows(kv, d_head)
    out = {theirs: state[ours] for ours, theirs in _GLOBAL.items()}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({theirs + t: state[ours + o] for o, t in _PER_LAYER.items()})
        qkv = state[ours + "attn.qkv.weight"]
        q, k, v = qkv.split([heads * d_head, kv * d_head, kv * d_head])
        rows = (q[q_rows.to(q.device)], k[k_rows.to(k.device)], v.contiguous())
        out.update({theirs + name: t for name, t in zip(_QKV, rows)})
    return out


def from_llama(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict as our TransformerLM's (the inverse of to_llama, bit for bit). A missing or
    unexpected weight is a LlamaConfigError naming it."""
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    expected = set(to_llama_names(cfg))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"no {missing[0]}" if missing else f"an unexpected {unexpected[0]}"
        raise LlamaConfigError(f"the weights do not fit the config: {what} ({len(missing)} missing, "
                               f"{len(unexpected)} unexpected)")
    d_head, heads, kv = cfg.d_head, cfg.n_heads, cfg.kv_heads
    q_back, k_back = rope_rows(heads, d_head).argsort(), rope_rows(kv, d_head).argsort()
    out = {ours: state[theirs] for ours, theirs in _GLOBAL.items()}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours + o: state[theirs + t] for o, t in _PER_LAYER.items()})
        q, k, v = (state[theirs + name] for name in _QKV)
        out[ours + "attn.qkv.weight"] = torch.cat([q[q_back.to(q.device)], k[k_back.to(k.device)], v])
    return out


def to_llama_names(cfg: ModelConfig) -> list[str]:
    """The weight names of LlamaForCausalLM for `cfg`."""
    per_layer = [*_PER_LAYER.values(), *_QKV]
    return [*_GLOBAL.values(), *(f"model.layers.{i}.{name}" for i in range(cfg.n_layers) for name in per_layer)]


def mismatches(cfg: ModelConfig) -> list[str]:
    """The features of `cfg` a Llama config cannot express, one phrase each; empty when it is a plain Llama."""
    found = []
    if cfg.window is not None and "L" in cfg.window_pattern:
        found.append(f"sliding-window attention (window {cfg.window}, pattern {cfg.window_pattern})")
    if cfg.attn_softcap is not None:
        found.append(f"attention softcap {cfg.attn_softcap:g}")
    if cfg.qk_norm:
        found.append("QK-norm")
    if cfg.logit_softcap is not None:
        found.append(f"logit softcap {cfg.logit_softcap:g}")
    if cfg.mlp != "swiglu":
        found.append(f"the {cfg.mlp} MLP (Llama's is SwiGLU)")
    return found


def llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """The LlamaConfig fields of `cfg` (LlamaConfig(**llama_config(cfg)) builds the same architecture). Written in
    transformers 4.x's spelling (rope_theta, rope_scaling), which 5.x reads too."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.d_head, "hidden_act": "silu",
            "max_position_embeddings": cfg.context_length, "rms_norm_eps": NORM_EPS, "rope_theta": cfg.rope_theta,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "tie_word_embeddings": False}


# What a key must hold for our model to compute what Llama computes, and LlamaConfig's default when it is absent.
_MUST = {"attention_bias": (False, False), "mlp_bias": (False, False), "tie_word_embeddings": (False, False),
         "hidden_act": ("silu", "silu"), "rms_norm_eps": (NORM_EPS, 1e-6)}
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_config_from_llama(config: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Llama `config.json`; LlamaConfigError names the first key (and value) it cannot express."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise LlamaConfigError(f"model_type {model_type!r}: only Llama models (model_type 'llama') map to ours")
    for key in _SHAPE_KEYS:
        if not isinstance(config.get(key), int):
            raise LlamaConfigError(f"{key} {config.get(key)!r}: an integer is needed")
    for key, (ours, default) in _MUST.items():
        value = config.get(key, default)
        if value != ours:
            absent = " (absent: Llama's default)" if key not in config else ""
            raise LlamaConfigError(f"{key} {json_value(value)}{absent}: ours is {json_value(ours)}")
    theta = _rope_theta(config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") is not None and config["head_dim"] * heads != hidden:
        raise LlamaConfigError(f"head_dim {config['head_dim']}: ours is hidden_size / num_attention_heads "
                               f"({hidden} / {heads})")
    kv = config.get("num_key_value_heads") or heads
    values = dict(d_model=hidden, n_layers=config["num_hidden_layers"], n_heads=heads,
                  d_ff=config["intermediate_size"], vocab_size=config["vocab_size"],
                  context_length=config.get("max_position_embeddings", 2048), rope_theta=theta,
                  n_kv_heads=None if kv == heads else kv)
    problem = ModelConfig.problem(_unchecked(values))
    if problem:
        raise LlamaConfigError(f"{problem} (from config.json)")
    return ModelConfig(**values)


def _rope_theta(config: dict[str, Any]) -> float:
    """RoPE's base; scaled RoPE (any rope_type but 'default', in 4.x's rope_scaling or 5.x's rope_parameters) is
    refused: our tables are the plain ones."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type")) if isinstance(value, dict) else value
        if kind != "default":
            raise LlamaConfigError(f"{key} {json_value(value)}: ours is plain RoPE (no scaling)")
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", config.get("rope_theta", 10_000.0)))


def _unchecked(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig without its __post_init__ check, to report its problem in config.json's terms."""
    cfg = object.__new__(ModelConfig)
    defaults = ModelConfig.__dataclass_fields__
    for name, f in defaults.items():
        object.__setattr__(cfg, name, values.get(name, f.default))
    return cfg


def json_value(value: Any) -> str:
    """A value as config.json spells it (true, null, 1e-06)."""
    return json.dumps(value)


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's spelling of a torch dtype (torch_dtype: "float32")."""
    return str(dtype).removeprefix("torch.")


__all__ = ["ARCHITECTURE", "NORM_EPS", "LlamaConfigError", "from_llama", "llama_config", "mismatches",
           "model_config_from_llama", "rope_rows", "to_llama", "to_llama_names"]

