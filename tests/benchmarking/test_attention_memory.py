import pytest
import torch

from attention import get_attention
from benchmarking.attention_memory import (SavedTensorRecorder, expected_after_forward_bytes,
                                           expected_forward_peak_bytes, expected_saved_bytes, expected_tensors,
                                           explain_backend)
from benchmarking.attention_point import AttentionPoint, make_inputs


def test_seed_figure_naive_probabilities():
    # batch 8, seq 16384, fp32: one (seq x seq) matrix per sequence is 8 GiB; scores + probabilities 16 GiB.
    p = AttentionPoint(8, 1, 16384, 64, "fp32", False)
    tensors = {t.name.split()[0]: t for t in expected_tensors("naive", p)}
    assert tensors["P"].nbytes == 8 * 16384**2 * 4 == 8 * 1024**3
    assert tensors["P"].nbytes + tensors["S"].nbytes == 16 * 1024**3
    assert expected_saved_bytes(expected_tensors("naive", p)) == 8 * 1024**3


def test_fused_model_is_linear_in_seq():
    small, big = (AttentionPoint(1, 16, n, 64, "bf16", True) for n in (4096, 8192))
    saved = [expected_saved_bytes(expected_tensors("flash", p)) for p in (small, big)]
    assert saved[1] == 2 * saved[0]
    assert saved[0] == 16 * 4096 * 64 * 2 + 16 * 4096 * 4  # o (bf16) + L (fp32)
    assert expected_tensors("not-a-backend", small) is None


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_model_matches_what_autograd_saves_on_cpu(backend, causal):
    p = AttentionPoint(2, 2, 48, 16, "fp32", causal)
    inputs = make_inputs(p, "cpu")
    with SavedTensorRecorder(exclude=inputs.leaves()) as recorder:
        out = get_attention(backend)(inputs.q, inputs.k, inputs.v, causal=causal)
    assert recorder.total_bytes == expected_saved_bytes(expected_tensors(backend, p))
    assert out.requires_grad


def test_recorder_counts_a_storage_once_and_skips_excluded():
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with SavedTensorRecorder(exclude=[x]) as recorder:
        h = x @ w  # saves x (excluded) and w
        y = h.exp()  # saves its result
        (y @ w).sum()  # saves y and w again: counted once
    assert recorder.total_bytes == 2 * 64 * 64 * 4
    assert sorted(s.shape for s in recorder.tensors) == [(64, 64), (64, 64)]


def test_peak_model_for_naive_counts_the_transient_scores():
    p = AttentionPoint(1, 1, 128, 16, "fp32", False)
    tensors = expected_tensors("naive", p)
    n2 = 128 * 128 * 4
    assert expected_after_forward_bytes(tensors) == n2 + 128 * 16 * 4
    assert expected_forward_peak_bytes(tensors) == 2 * n2 + 128 * 16 * 4


def test_explain_backend_text():
    p = AttentionPoint(1, 2, 64, 16, "fp32", False)
    measured = {"status": "ok", "saved_tensors_mib": 32 / 1024, "saved_mib": None, "fwd_peak_mib": None}
    text = explain_backend("naive", p, measured, None)
    assert "saved        P = softmax(S) probabilities   1x2x64x64" in text
    assert "saved for backward (not q,k,v): expected 32.00 KiB, measured 32.00 KiB" in text
    oom = explain_backend("mystery", p, {"status": "OOM", "note": "CUDA out of memory"}, None)
    assert "no memory model" in oom and "measured: OOM (CUDA out of memory)" in oom
