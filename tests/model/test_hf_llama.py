"""model/hf_llama.py: our TransformerLM and LlamaForCausalLM map onto each other, weights and config, GQA included."""

import re

import pytest
import torch

from model import ModelConfig, TransformerLM
from model.hf_llama import (LlamaConfigError, from_llama, llama_config, mismatches, model_config_from_llama,
                            to_llama, to_llama_names)

transformers = pytest.importorskip("transformers")

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=96, vocab_size=101, context_length=32)
GQA = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=96, vocab_size=101, context_length=32, n_kv_heads=2,
                  rope_theta=500.0)


def llama_of(cfg: ModelConfig):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).eval()


@pytest.mark.parametrize("cfg", [CFG, GQA], ids=["mha", "gqa"])
def test_our_weights_in_llama_compute_our_logits(cfg):
    torch.manual_seed(0)
    ours = TransformerLM(cfg, "naive").eval()
    theirs = llama_of(cfg)
    theirs.load_state_dict(to_llama(ours.state_dict(), cfg))  # strict: every Llama weight, nothing else
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    assert theirs.config.num_key_value_heads == cfg.kv_heads


@pytest.mark.parametrize("cfg", [CFG, GQA], ids=["mha", "gqa"])
def test_the_mapping_round_trips_bit_for_bit(cfg):
    torch.manual_seed(1)
    state = TransformerLM(cfg).state_dict()
    theirs = to_llama(state, cfg)
    assert sorted(theirs) == sorted(to_llama_names(cfg))
    back = from_llama(theirs, cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_llama_weights_map_to_ours_and_compute_its_logits():
    """The other way: a random Llama (GQA, another RoPE base) read as our model."""
    torch.manual_seed(2)
    theirs = llama_of(GQA)
    cfg = model_config_from_llama(theirs.config.to_dict())
    assert cfg == GQA
    ours = TransformerLM(cfg, "naive").eval()
    ours.load_state_dict(from_llama(theirs.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_missing_or_extra_weights_are_named():
    state = to_llama(TransformerLM(CFG).state_dict(), CFG)
    state["model.rotary_emb.inv_freq"] = torch.zeros(8)  # some checkpoints carry it: recomputed, not a weight
    assert len(from_llama(state, CFG)) == len(TransformerLM(CFG).state_dict())
    del state["lm_head.weight"]
    with pytest.raises(LlamaConfigError, match=r"^the weights do not fit the config: no lm_head.weight \(1 missing, "
                                               r"0 unexpected\)$"):
        from_llama(state, CFG)


LLAMA = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": 1e-5}


def test_a_minimal_config_takes_llamas_defaults():
    cfg = model_config_from_llama(LLAMA)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (64, 2, 4, 96, 101)
    assert (cfg.n_kv_heads, cfg.context_length, cfg.rope_theta) == (None, 2048, 10_000.0)
    v5 = model_config_from_llama({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                  "num_key_value_heads": 1, "max_position_embeddings": 64})
    assert (v5.rope_theta, v5.n_kv_heads, v5.context_length) == (5e5, 1, 64)
    assert model_config_from_llama({**LLAMA, "rope_theta": 123, "rope_scaling": None}).rope_theta == 123.0


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias true: ours is false"),
    ({"mlp_bias": True}, "mlp_bias true: ours is false"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings true: ours is false"),
    ({"hidden_act": "gelu"}, 'hidden_act "gelu": ours is "silu"'),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps 1e-06: ours is 1e-05"),
    ({"rms_norm_eps": None}, "rms_norm_eps 1e-06 (absent: Llama's default): ours is 1e-05"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     'rope_scaling {"rope_type": "llama3", "factor": 8.0}: ours is plain RoPE (no scaling)'),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     'rope_parameters {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}: ours is plain RoPE'),
    ({"head_dim": 32}, "head_dim 32: ours is hidden_size / num_attention_heads (64 / 4)"),
    ({"model_type": "mistral"}, "model_type 'mistral': only Llama models"),
    ({"hidden_size": None}, "hidden_size None: an integer is needed"),
    ({"num_key_value_heads": 3}, "n_kv_heads must divide n_heads (4), got 3 (from config.json)"),
])
def test_what_our_model_cannot_express_is_refused_naming_the_key(change, message):
    config = {**LLAMA, **change}
    config = {k: v for k, v in config.items() if v is not None or k != "rms_norm_eps"}
    with pytest.raises(LlamaConfigError, match="^" + re.escape(message)):
        model_config_from_llama(config)


def test_windows_and_softcap_are_what_llama_cannot_express():
    assert mismatches(CFG) == mismatches(GQA) == []
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, window=8, window_pattern="LG", attn_softcap=30.0)
    assert mismatches(cfg) == ["sliding-window attention (window 8, pattern LG)", "attention softcap 30"]
    assert mismatches(ModelConfig(window=8, window_pattern="G")) == []  # no local layer: every layer is global


def test_the_recipe_options_llama_cannot_express():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, qk_norm=True, mlp="relu2", zero_init_residual=True,
                      logit_softcap=15.0)
    # zero init is only a start
    assert mismatches(cfg) == ["QK-norm", "logit softcap 15", "the relu2 MLP (Llama's is SwiGLU)"]
