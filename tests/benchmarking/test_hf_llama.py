"""The Hugging Face peer: same sizes as our presets, our call signature, and a clear error without transformers."""

import sys

import pytest
import torch
import torch.nn.functional as F

import bench_model
from benchmarking.hf_llama import HFLlama
from model import ModelConfig, TransformerLM, config_for

TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256, context_length=32)


@pytest.mark.parametrize("size, n_kv_heads", [("small", None), ("large", None), ("2.7B", None), ("large", 4)])
def test_parameter_count_matches_our_preset(size, n_kv_heads):
    cfg = config_for(size, n_kv_heads=n_kv_heads)
    with torch.device("meta"):  # no memory: only the shapes are compared
        ours, peer = TransformerLM(cfg), HFLlama(cfg)
    assert peer.num_params() == ours.num_params()
    assert peer.num_params(non_embedding=True) == ours.num_params(non_embedding=True)


def test_loss_is_cross_entropy_of_its_logits():
    torch.manual_seed(0)
    peer = HFLlama(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    targets = torch.randint(0, TINY.vocab_size, (2, 32))
    logits = peer(ids)
    assert logits.shape == (2, 32, TINY.vocab_size)
    expected = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())
    torch.testing.assert_close(peer(ids, targets).double(), expected, rtol=1e-5, atol=1e-5)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(RuntimeError, match="needs transformers: pip install transformers"):
        HFLlama(TINY)


@pytest.mark.slow  # bench_model.py end to end
def test_bench_model_times_ours_and_the_peer_in_one_run(tmp_path):
    rows = bench_model.main(["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128",
                             "--vocab-size", "256", "--batch-size", "2", "--warmup", "1", "--steps", "2",
                             "--device", "cpu", "--context-lengths", "16", "--attn", "naive,sdpa",
                             "--impl", "ours,hf", "--mode", "train-step", "--out", str(tmp_path)])
    assert [(r["impl"], r["attn"]) for r in rows] == [("ours", "naive"), ("ours", "sdpa"), ("hf", "sdpa")]
    assert all(r["status"] == "ok" and r["total_ms_mean"] > 0 for r in rows)
    assert len({r["params"] for r in rows}) == 1  # the same model size on both sides
    assert "hf-llama" in (tmp_path / "results.md").read_text()


def test_bench_model_rejects_an_unknown_impl(capsys):
    with pytest.raises(SystemExit):
        bench_model.main(["--impl", "megatron", "--device", "cpu"])
    assert "unknown implementation 'megatron'; valid: ours, hf" in capsys.readouterr().err
