"""profiling.nvtx: a no-op unless enabled; when enabled, balanced push/pop around naive attention's phases."""

import math

import pytest
import torch

from attention import get_attention
from profiling import nvtx


@pytest.fixture
def nvtx_calls(monkeypatch):
    """Record NVTX push/pop instead of calling the (possibly absent) CUDA NVTX library."""
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    yield calls
    nvtx.enable(False)


def _qkv(seq: int, d_head: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seq * 31 + d_head)
    return [torch.randn(2, 3, seq, d_head, generator=g, dtype=dtype) for _ in range(3)]


def _reference(q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_disabled_range_is_a_shared_null_context_and_calls_nothing(nvtx_calls):
    nvtx.enable(False)
    assert nvtx.range("a") is nvtx.range("b")  # no object built per call
    with nvtx.range("forward"):
        pass
    get_attention("naive")(*_qkv(8, 16), causal=True)
    assert nvtx_calls == []


@pytest.mark.parametrize("seq,d_head", [(8, 16), (33, 32)])
def test_enabled_naive_attention_pushes_its_three_phases(nvtx_calls, seq, d_head):
    nvtx.enable(True)
    q, k, v = _qkv(seq, d_head)
    out = get_attention("naive")(q, k, v, causal=True)
    assert nvtx_calls == [
        ("push", "attention.scores"), ("pop", None),
        ("push", "attention.softmax"), ("pop", None),
        ("push", "attention.output"), ("pop", None),
    ]
    torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_enabled_range_pops_even_when_the_body_raises(nvtx_calls):
    nvtx.enable(True)
    with pytest.raises(ValueError):
        with nvtx.range("step 0"):
            raise ValueError("boom")
    assert nvtx_calls == [("push", "step 0"), ("pop", None)]


def test_enable_toggles(nvtx_calls):
    nvtx.enable(True)
    assert nvtx.is_enabled()
    nvtx.enable(False)
    assert not nvtx.is_enabled()


def test_unavailable_reports_a_missing_nvtx_library(monkeypatch):
    def fail(name):
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", fail)
    assert "CUDA build" in nvtx.unavailable()


def test_unavailable_is_none_when_nvtx_works(nvtx_calls):
    assert nvtx.unavailable() is None
    assert nvtx_calls == [("push", "nvtx-probe"), ("pop", None)]


@pytest.mark.slow  # torch.compile
def test_enabled_ranges_vanish_inside_torch_compile(nvtx_calls):
    # A push/pop while dynamo traces would split the compiled graph; inside compiled code the ranges are no-ops.
    # Earlier tests may have filled dynamo's per-function cache (8 shapes), after which it runs eager.
    torch._dynamo.reset()
    nvtx.enable(True)
    q, k, v = _qkv(16, 16)
    out = get_attention("compiled")(q, k, v, causal=True)
    assert nvtx_calls == []
    torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=1e-5, atol=1e-5)
