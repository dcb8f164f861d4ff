"""benchmarking.model_memory: exact parameter count, and saved activations against what autograd really saves."""

import pytest
import torch

from benchmarking.model_memory import (
    MODES,
    explain_memory,
    format_breakdown,
    layer_activations,
    matmul_weight_count,
    measure_saved_bytes,
    param_count,
)
from model import PRESETS, ModelConfig, TransformerLM, config_for
from model.layers import Linear

TINY = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256, context_length=64)


@pytest.mark.parametrize("size", list(PRESETS))
def test_param_count_matches_num_params_for_every_preset(size):
    cfg = config_for(size)
    with torch.device("meta"):  # shapes only: no 10B-parameter allocation
        model = TransformerLM(cfg)
    assert param_count(cfg) == model.num_params()


@pytest.mark.parametrize("dims", [(64, 2, 4, 128, 256, None), (96, 3, 6, 80, 1000, None), (32, 1, 2, 64, 10, None),
                                  (64, 2, 4, 128, 256, 2), (96, 3, 6, 80, 1000, 1)])
@pytest.mark.parametrize("mlp", ["swiglu", "relu2"])
def test_param_count_matches_num_params_for_custom_dims(dims, mlp):
    d, n_layers, h, f, v, kv = dims
    cfg = ModelConfig(d_model=d, n_layers=n_layers, n_heads=h, d_ff=f, vocab_size=v, n_kv_heads=kv, mlp=mlp)
    model = TransformerLM(cfg)
    assert param_count(cfg) == model.num_params()
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert matmul_weight_count(cfg) == linears


def _measured_saved(cfg: ModelConfig, attn: str, batch: int, seq: int, dtype: str) -> int:
    torch.manual_seed(seq)
    model = TransformerLM(cfg, attn)
    ids = torch.randint(cfg.vocab_size, (batch, seq))
    targets = torch.randint(cfg.vocab_size, (batch, seq))

    def loss():  # the bench_model.py loss (training.step): the model's own loss under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            return model(ids, targets)

    return measure_saved_bytes(loss, exclude=list(model.parameters()))


@pytest.mark.parametrize("attn", ["naive", "sdpa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 40)])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_saved_activations_match_what_autograd_saves(attn, dtype, batch, seq, n_kv_heads):
    cfg = ModelConfig(**TINY, n_kv_heads=n_kv_heads)
    measured = _measured_saved(cfg, attn, batch, seq, dtype)
    mb = explain_memory(cfg, batch, seq, dtype, "forward-backward", device_type="cpu", attn=attn)
    weight_copies = 2 * matmul_weight_count(cfg) if dtype == "bf16" else 0  # saved by each Linear too
    expected = mb.saved_bytes + weight_copies
    assert measured == pytest.approx(expected, rel=0.02), format_breakdown(mb, [("measured", measured)])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_residual_stream_is_named_in_autocasts_dtype_and_saved_as_rmsnorms_fp32_upcast(dtype):
    terms = {t.name: t.nbytes for t in layer_activations(ModelConfig(**TINY), 2, 16, dtype, device_type="cpu").terms}
    upcast = "; its RMSNorm saves it upcast to fp32" if dtype == "bf16" else ""
    assert terms[f"block input x (residual stream, {dtype}; attn RMSNorm input{upcast})"] == 2 * 16 * 64 * 4
    assert terms[f"residual after attention ({dtype}; FFN RMSNorm input{upcast})"] == 2 * 16 * 64 * 4


def test_naive_scores_grow_with_context_squared_and_fused_do_not():
    cfg = ModelConfig(**TINY)
    quad = {t.name: t.nbytes for t in layer_activations(cfg, 2, 512, "fp32", attn="naive").terms}
    assert quad["attention probs (softmax output)"] == 2 * 4 * 512 * 512 * 4  # B * h * T^2 * 4 bytes
    double = {t.name: t.nbytes for t in layer_activations(cfg, 2, 1024, "fp32", attn="naive").terms}
    assert double["attention probs (softmax output)"] == 4 * quad["attention probs (softmax output)"]
    fused = layer_activations(cfg, 2, 512, "fp32", attn="sdpa")
    assert not any("probs" in t.name for t in fused.terms)
    cuda_bf16 = {t.name for t in layer_activations(cfg, 2, 512, "bf16", device_type="cuda", attn="naive").terms}
    assert "attention probs, bf16 copy for probs @ v" in cuda_bf16  # CUDA autocast softmax is fp32


def test_state_terms_follow_the_mode():
    cfg = ModelConfig(**TINY)
    p = param_count(cfg)
    state = {m: {t.name: t.nbytes for t in explain_memory(cfg, 2, 32, "fp32", m).state[0].terms} for m in MODES}
    assert state["forward"] == {"parameters (fp32 master weights)": 4 * p}
    assert state["forward-backward"]["gradients (fp32)"] == 4 * p
    assert "AdamW exp_avg and exp_avg_sq (fp32)" not in state["forward-backward"]
    assert state["train-step"]["AdamW exp_avg and exp_avg_sq (fp32)"] == 8 * p
    bf16_state = {t.name: t.nbytes for t in explain_memory(cfg, 2, 32, "bf16", "train-step",
                                                           optimizer="adamw-bf16").state[0].terms}
    assert bf16_state["AdamW exp_avg and exp_avg_sq (bf16)"] == 4 * p
    fwd = explain_memory(cfg, 2, 32, "fp32", "forward")
    assert fwd.saved_bytes == 0 and fwd.expected_peak_bytes > 4 * p


@pytest.mark.slow  # optimizer steps
def test_muons_state_is_what_its_optimizers_hold():
    """A momentum per block matrix (Muon) and two moments for the rest (AdamW), against the built optimizer."""
    from tests.training.resolved import resolved
    from training.step import build_step

    config = resolved(model=ModelConfig(**{**TINY, "context_length": 32}), optim={"optimizer": "muon"})
    step = build_step(TransformerLM(config.model, "sdpa"), config)
    ids = torch.randint(config.model.vocab_size, (4, 33))
    step(ids[:, :-1], ids[:, 1:])
    held = {name: sum(t.nbytes for opt in step.optimizer.optimizers for s in opt.state.values()
                      for key, t in s.items() if key in keys)
            for name, keys in (("muon", {"momentum_buffer"}), ("adamw", {"exp_avg", "exp_avg_sq"}))}
    terms = {t.name: t.nbytes for t in explain_memory(config.model, 4, 32, "fp32", "train-step",
                                                      optimizer="muon").state[0].terms}
    assert terms["Muon momentum of the blocks' matrices (fp32)"] == held["muon"] > 0
    assert terms["AdamW exp_avg and exp_avg_sq of the rest (fp32)"] == held["adamw"] > 0


def test_logits_term_is_batch_context_vocab_times_four():
    cfg = ModelConfig(**{**TINY, "vocab_size": 10_000})
    mb = explain_memory(cfg, 4, 128, "bf16", "train-step")
    head = {t.name: t.nbytes for t in mb.saved[1].terms}
    assert head["log-softmax of the logits (fp32, saved by cross-entropy)"] == 4 * 128 * 10_000 * 4


def test_format_lists_terms_and_measured_figures():
    mb = explain_memory(ModelConfig(**TINY), 2, 32, "fp32", "train-step", attn="naive")
    text = format_breakdown(mb, [("measured peak", 3 * 1024**2), ("measured elsewhere", None)])
    for needle in ("parameters (fp32 master weights)", "attention probs", "x 2 layers", "expected peak",
                   "measured peak", "3.00 MiB", "n/a"):
        assert needle in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="fp16"), "dtype must be"),
    (dict(mode="backward"), "mode must be one of"),
    (dict(batch=0), "batch and seq must be >= 1"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(batch=2, seq=16, dtype="fp32", mode="forward") | kwargs
    with pytest.raises(ValueError, match=match):
        explain_memory(ModelConfig(**TINY), **args)


@pytest.mark.parametrize("change", [{"mlp": "relu2"}, {"qk_norm": True}, {"logit_softcap": 15.0}])
def test_the_memory_model_refuses_the_blocks_it_does_not_describe(change):
    with pytest.raises(ValueError, match="the memory model describes SwiGLU blocks without QK-norm and an LM head "
                                         "without a softcap"):
        explain_memory(ModelConfig(**TINY, **change), 2, 64, "bf16", "train-step")
