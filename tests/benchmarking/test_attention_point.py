import pytest
import torch

from benchmarking.attention_point import (AttentionPoint, check_rows, check_slices, make_inputs, random_documents,
                                          visible_pairs)
from tests.benchmarking.dense_mask import dense_visible


@pytest.mark.parametrize("causal", [False, True])
def test_flop_counts(causal):
    p = AttentionPoint(batch=8, heads=2, seq=1024, d_head=64, dtype="fp32", causal=causal)
    forward = 4 * 8 * 2 * 1024 * 1024 * 64 / (2 if causal else 1)
    assert p.flop("fwd") == forward
    assert p.flop("bwd") == 2.5 * forward
    assert p.flop("fwdbwd") == 3.5 * forward


def test_label_names_every_field():
    assert AttentionPoint(8, 1, 16384, 64, "bf16", True).label() == "b8 h1 seq=16384 d=64 bf16 causal"
    assert AttentionPoint(1, 2, 16, 32, "fp32", False).label() == "b1 h2 seq=16 d=32 fp32 full"


def test_check_rows_and_slices():
    assert check_rows(10, max_rows=64).tolist() == list(range(10))
    rows = check_rows(1000, max_rows=16)
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 16 and bool((rows.diff() > 0).all())
    assert check_slices(1) == [0] and check_slices(6) == [0, 5]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_make_inputs_random_reproducible_and_masked(dtype):
    p = AttentionPoint(2, 3, 40, 16, dtype, True)
    a, b = make_inputs(p, "cpu", seed=1, max_check_rows=8), make_inputs(p, "cpu", seed=1, max_check_rows=8)
    c = make_inputs(p, "cpu", seed=2, max_check_rows=8)
    for t in (a.q, a.k, a.v, a.grad_out):
        assert t.shape == (2, 3, 40, 16) and t.dtype == p.torch_dtype
        assert float(t.detach().float().std()) == pytest.approx(1.0, abs=0.15)  # standard normal, never zeros
    assert all(t.requires_grad and t.is_leaf for t in a.leaves())
    assert torch.equal(a.q, b.q) and torch.equal(a.grad_out_check, b.grad_out_check)
    assert not torch.equal(a.q, c.q)
    assert not torch.equal(a.q, a.k)
    # The correctness gradient is non-zero exactly on the checked rows of the checked slices.
    flat = a.grad_out_check.reshape(6, 40, 16)
    nonzero_rows = (flat != 0).any(-1)
    expected = torch.zeros(6, 40, dtype=torch.bool)
    expected[torch.tensor(a.check_slices)[:, None], a.check_rows[None, :]] = True
    assert a.check_slices == [0, 5] and len(a.check_rows) == 8
    assert torch.equal(nonzero_rows, expected)
    assert a.nbytes() == 5 * 2 * 3 * 40 * 16 * p.torch_dtype.itemsize


def test_label_names_the_variants():
    p = AttentionPoint(1, 16, 2048, 64, "bf16", True, kv_heads=4, window=256, softcap=50.0, doc_len=128)
    assert p.label() == "b1 h16 seq=2048 d=64 bf16 causal kv4 window=256 softcap=50 docs=128"
    assert AttentionPoint(1, 4, 16, 16, "fp32", True, kv_heads=4).label() == "b1 h4 seq=16 d=16 fp32 causal"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("doc_len", [None, 1, 7])
def test_visible_pairs_counts_the_mask(causal, window, doc_len):
    seq = 50
    doc_ids = None if doc_len is None else random_documents(3, seq, doc_len, torch.Generator().manual_seed(0))
    seen = dense_visible(seq, causal, window, doc_ids)
    assert visible_pairs(seq, causal, window, doc_ids) == pytest.approx(seen.reshape(-1, seq, seq).sum((1, 2))
                                                                         .double().mean().item())


def test_random_documents_have_the_mean_length_and_differ_per_sequence():
    ids = random_documents(4, 100_000, 1024, torch.Generator().manual_seed(1))
    assert ids.shape == (4, 100_000) and ids.dtype == torch.int32
    assert bool((ids.diff(dim=-1) >= 0).all()) and bool((ids.diff(dim=-1) <= 1).all())
    lengths = torch.unique_consecutive(ids[0], return_counts=True)[1][:-1].double()  # the last one is cut
    assert lengths.mean().item() == pytest.approx(1024, rel=0.1) and lengths.max() <= 2047
    assert not torch.equal(ids[0], ids[1])


def test_make_inputs_with_gqa_and_documents():
    p = AttentionPoint(2, 6, 64, 16, "fp32", True, kv_heads=2, window=8, doc_len=10)
    inputs = make_inputs(p, "cpu", seed=0)
    assert inputs.q.shape == (2, 6, 64, 16) and inputs.k.shape == inputs.v.shape == (2, 2, 64, 16)
    assert inputs.doc_ids.shape == (2, 64)
    assert inputs.kv_slices() == [0, 3]  # query slices 0 (b0 h0) and 11 (b1 h5): kv heads 0 and 2*1 + 5//3
    assert inputs.pairs == visible_pairs(64, True, 8, inputs.doc_ids) < 64 * 65 / 2
    assert p.flop("fwd", inputs.pairs) == 4 * 2 * 6 * inputs.pairs * 16
