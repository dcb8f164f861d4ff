import pytest
import torch

from benchmarking.attention_point import AttentionPoint, check_rows, check_slices, make_inputs


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
