"""The model's attention variants: GQA, local/global windows, softcap, packed documents; and their FLOPs."""

from __future__ import annotations

import pytest
import torch

from model import TransformerLM
from model.config import ModelConfig
from training.metrics import flops_per_token, non_embedding_params

VARIANTS = {"n_kv_heads": 2, "window": 5, "window_pattern": "LG", "attn_softcap": 20.0}
# flash runs on a GPU where there is one (under the Triton interpreter otherwise), with TF32 matmuls in fp32.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-5 if DEVICE == "cpu" else 2e-3


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "vocab_size": 97,
                          "context_length": 24, **overrides})


def test_gqa_projects_k_and_v_to_fewer_heads_and_counts_them():
    cfg = tiny(n_kv_heads=2)
    model = TransformerLM(cfg)
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 2 * 16, 64)
    assert model.num_params(non_embedding=True) == non_embedding_params(cfg)


def test_window_pattern_makes_local_and_global_layers():
    cfg = tiny(n_layers=4, window=5, window_pattern="LLLG")
    assert [cfg.layer_window(i) for i in range(4)] == [5, 5, 5, None]
    windows = [b.attn.variant.get("window") for b in TransformerLM(cfg).blocks]
    assert windows == [5, 5, 5, None]


@pytest.mark.parametrize("bad, message", [
    ({"n_kv_heads": 3}, "n_kv_heads must divide"), ({"window": 0}, "window must be >= 1"),
    ({"window_pattern": "LX"}, "window_pattern"), ({"attn_softcap": 0.0}, "attn_softcap must be > 0"),
])
def test_bad_variants_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny(**bad)


def test_windows_count_only_the_scores_they_compute():
    plain, windowed = tiny(context_length=1024), tiny(context_length=1024, window=128, window_pattern="LG")
    attention = flops_per_token(plain) - 6 * non_embedding_params(plain)
    local = flops_per_token(windowed) - 6 * non_embedding_params(windowed)
    # One global layer (half the attention FLOPs) and one that sees ~128 - 128 * 127 / 2048 of ~512.5 keys.
    assert local == pytest.approx(attention / 2 * (1 + (128 - 128 * 127 / 2048) / 512.5))


@pytest.mark.parametrize("attn", ["naive", pytest.param("flash", marks=pytest.mark.slow)])
def test_packed_documents_match_each_document_alone(attn):
    """A row of packed documents gives each document the logits it gets alone (positions restart, no leaks)."""
    torch.manual_seed(0)
    model = TransformerLM(tiny(**VARIANTS), attn).to(DEVICE)
    ids = torch.randint(0, 97, (1, 24), device=DEVICE)
    doc_ids = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5], device=DEVICE)
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids)
        alone = torch.cat([model(ids[:, a:b]) for a, b in ((0, 7), (7, 19), (19, 24))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=10 * TOLERANCE, atol=10 * TOLERANCE)


@pytest.mark.slow  # training under three backends
def test_variants_train_under_naive_flash_torch_and_flash():
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 24), device=DEVICE)
    doc_ids = torch.cumsum(torch.rand(2, 24, device=DEVICE) < 0.2, dim=-1)
    losses = {}
    for attn in ("naive", "flash-torch", "flash"):
        torch.manual_seed(1)
        model = TransformerLM(tiny(**VARIANTS), attn).to(DEVICE)
        loss = model(ids, ids, doc_ids=doc_ids)
        loss.backward()
        losses[attn] = loss.item()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert losses["flash"] == pytest.approx(losses["naive"], rel=TOLERANCE)
    assert losses["flash-torch"] == pytest.approx(losses["naive"], rel=TOLERANCE)
