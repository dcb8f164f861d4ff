import pytest
import torch
import torch.nn.functional as F

from benchmarking.attention_point import AttentionPoint, make_inputs
from benchmarking.attention_reference import errors, reference
from tests.benchmarking.dense_mask import dense_visible


def full_float64(inputs, causal):
    """Dense float64 attention of the whole tensors with the correctness pass's upstream gradient."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in inputs.leaves())
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(inputs.grad_out_check.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("seq,max_rows", [(24, 64), (200, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_sampled_reference_equals_dense_float64(seq, max_rows, causal):
    # With only sampled rows carrying gradient, the row-subset reference must still give exact dq, dk, dv.
    p = AttentionPoint(2, 2, seq, 16, "fp32", causal)
    inputs = make_inputs(p, "cpu", seed=3, max_check_rows=max_rows)
    ref = reference(inputs, causal)
    out, dq, dk, dv = full_float64(inputs, causal)
    pick = lambda t: t.reshape(-1, seq, 16)[inputs.check_slices]  # noqa: E731
    torch.testing.assert_close(ref.out_rows, pick(out)[:, inputs.check_rows], rtol=1e-10, atol=1e-10)
    for got, want in ((ref.dq, dq), (ref.dk, dk), (ref.dv, dv)):
        torch.testing.assert_close(got, pick(want), rtol=1e-10, atol=1e-10)
    assert float(ref.dk.abs().max()) > 0  # the check is not vacuous


def test_errors_pass_a_right_answer_and_fail_a_wrong_one():
    p = AttentionPoint(1, 2, 32, 16, "fp32", True)
    inputs = make_inputs(p, "cpu", seed=4)
    ref = reference(inputs, True)
    out, dq, dk, dv = full_float64(inputs, True)
    right = errors(ref, inputs, out.float(), "fp32", (dq.float(), dk.float(), dv.float()))
    assert right["check"] == "ok" and right["rel_err"] < 1e-6
    assert all(right[k] is not None for k in ("err_out", "err_dq", "err_dk", "err_dv"))

    wrong_out = out.float().clone()
    wrong_out[0, 1, -1] += 0.5  # one wrong element in the last row of the last checked slice
    assert errors(ref, inputs, wrong_out, "fp32")["check"] == "FAIL"
    wrong_dk = dk.float() * 1.1
    bad = errors(ref, inputs, out.float(), "fp32", (dq.float(), wrong_dk, dv.float()))
    assert bad["check"] == "FAIL" and bad["err_dk"] > 100 * bad["err_dv"]
    nan_out = out.float().clone()
    nan_out[0, 0, 0, 0] = float("nan")
    assert errors(ref, inputs, nan_out, "fp32")["check"] == "FAIL"
    forward_only = errors(ref, inputs, out.float(), "fp32")
    assert forward_only["err_dq"] is None and forward_only["check"] == "ok"


def dense_variant_float64(inputs, causal, window, softcap):
    """Every score in float64, K and V repeated per query head, then the window and document masks."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in inputs.leaves())
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-2, -1) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    seen = dense_visible(q.shape[-2], causal, window, inputs.doc_ids)
    seen = seen if inputs.doc_ids is None else seen[:, None]  # a head dim
    out = torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    out.backward(inputs.grad_out_check.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kv_heads,window,softcap,doc_len,causal", [
    (1, None, None, None, True), (2, 5, None, None, False), (4, None, 20.0, 6, True), (1, 3, 10.0, 9, False)])
def test_sampled_reference_with_variants_equals_dense_float64(kv_heads, window, softcap, doc_len, causal):
    seq, d = 40, 16
    p = AttentionPoint(2, 4, seq, d, "fp32", causal, kv_heads=kv_heads, window=window, softcap=softcap,
                       doc_len=doc_len)
    inputs = make_inputs(p, "cpu", seed=7, max_check_rows=12)
    ref = reference(inputs, causal, window=window, softcap=softcap)
    out, dq, dk, dv = dense_variant_float64(inputs, causal, window, softcap)
    kv = list(dict.fromkeys(inputs.kv_slices()))
    pick = lambda t, which: t.reshape(-1, seq, d)[which]  # noqa: E731
    torch.testing.assert_close(ref.out_rows, pick(out, inputs.check_slices)[:, inputs.check_rows], rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(ref.dq, pick(dq, inputs.check_slices), rtol=1e-10, atol=1e-10)
    for got, want in ((ref.dk, dk), (ref.dv, dv)):
        torch.testing.assert_close(got, pick(want, kv), rtol=1e-10, atol=1e-10)
    assert float(ref.dk.abs().max()) > 0
    right = errors(ref, inputs, out.float(), "fp32", (dq.float(), dk.float(), dv.float()))
    assert right["check"] == "ok"
    wrong = dv.float().clone()
    wrong.reshape(-1, seq, d)[kv[-1], -1] += 1.0  # the last key of the last checked key/value head
    assert errors(ref, inputs, out.float(), "fp32", (dq.float(), dk.float(), wrong))["check"] == "FAIL"
