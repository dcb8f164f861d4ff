"""flash's Gluon Hopper kernels through their host code (attention/flash/hopper/host.py): the 2-D views their
descriptors read, and on an sm_90 GPU the forward's O and L and the backward's dQ, dK, dV against float64, directly and
through flash's dispatch, plans, autograd and torch.compile. test_hopper_inputs.py has which inputs they take,
test_hopper_tiles.py their tiles."""

from __future__ import annotations

import time

import pytest
import torch

from attention import get_attention
from attention.flash import dispatch, flash_attention, flash_backward, flash_forward, use_kernels
from attention.flash.hopper import host as hopper, inputs as hopper_inputs
from attention.flash.hopper.tiles import HopperTiles
from tests.attention.conftest import random_doc_ids

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0) and hopper_inputs.gluon_problem() is None
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton's Gluon")
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def randn(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def make_qkv(b, h, n, d, dtype, layout, seed=0, device=DEVICE):
    """(batch, heads, seq, d) tensors in (batch, heads, seq, d) or (batch, seq, heads, d) memory."""
    if layout == "bshd":
        return [randn(b, n, h, d, seed=seed + i, dtype=dtype, device=device).transpose(1, 2) for i in range(3)]
    return [randn(b, h, n, d, seed=seed + i, dtype=dtype, device=device) for i in range(3)]


def reference(q, k, v, causal, scale):
    """(o, lse) in float64 on the CPU, by the naive formula."""
    return attention64(*(t.detach().cpu().double() for t in (q, k, v)), causal, scale)


def attention64(q, k, v, causal, scale):
    """(o, lse) of float64 tensors, differentiable."""
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def record_hopper_calls(monkeypatch) -> list[str]:
    """The names ("forward", "backward") of the Hopper passes run from now on, in order; they still run."""
    calls = []
    for kernel in ("forward", "backward"):
        real = getattr(hopper, kernel)
        monkeypatch.setattr(hopper, kernel, lambda *a, real=real, kernel=kernel, **kw: calls.append(kernel)
                            or real(*a, **kw))
    return calls


def backward_inputs64(q, k, v, do, causal, scale):
    """(L, delta, float64 (dq, dk, dv)) of (batch, heads, seq, d) inputs, k and v with a divisor of q's heads: L and
    delta from the float64 forward, in what the Hopper backward reads (fp32, and O in q's dtype for delta)."""
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    o64, lse64 = attention64(q64, k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1), causal, scale)
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double())
    o = o64.detach().to(DEVICE, q.dtype)
    lse = lse64.detach().to(DEVICE, torch.float32).contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    return lse, delta, grads64


def rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (1, 3, 5, 8), (2, 1, 5, 8), (2, 3, 1, 8)], ids=str)
def test_rows_view_addresses_every_element(layout, shape):
    b, h, n, d = shape
    t = make_qkv(b, h, n, d, torch.float32, layout, device="cpu")[0]
    view, rows_b, rows_h, cols_h = hopper.rows_view(t)
    assert view.data_ptr() == t.data_ptr() and view.dim() == 2
    for bi in range(b):
        for hi in range(h):
            for pos in range(n):
                row = bi * rows_b + hi * rows_h + pos
                assert torch.equal(view[row, hi * cols_h: hi * cols_h + d], t[bi, hi, pos])


def test_rows_view_refuses_other_memory_orders():
    t = randn(2, 3, 8, 5, device="cpu")
    assert hopper.rows_view(t.transpose(-2, -1)) is None  # d not contiguous
    assert hopper.rows_view(randn(3, 2, 5, 8, device="cpu").transpose(0, 1)) is None  # (heads, batch, seq, d)
    assert hopper.rows_view(randn(2, 3, 10, 8, device="cpu")[:, :, ::2]) is None  # strided seq


@pytest.mark.skipif(hopper_inputs.gluon_problem() is not None, reason="needs triton's Gluon")
def test_output_descriptor_needs_the_input_memory_order():
    q = randn(2, 3, 128, 64, dtype=torch.bfloat16, device="cpu")
    _, q_index = hopper._descriptor(q, 64)
    assert q_index == (3 * 128, 128, 0)
    assert hopper._output_descriptor(torch.empty_like(q), q_index, 64).block_shape == [64, 64]
    other_order = randn(2, 128, 3, 64, dtype=torch.bfloat16, device="cpu").transpose(1, 2)
    with pytest.raises(ValueError, match="memory order"):
        hopper._output_descriptor(other_order, q_index, 64)


@pytest.mark.skipif(hopper_inputs.gluon_problem() is not None, reason="needs triton's Gluon")
def test_row_stats_descriptor_covers_the_flat_vector():
    lse = randn(2 * 3, 256, device="cpu")  # (batch * heads, seq) fp32
    desc = hopper._row_stats_descriptor(lse, 64)
    assert list(desc.shape) == [2 * 3 * 256] and list(desc.block_shape) == [64] and desc.base.data_ptr() == lse.data_ptr()
    with pytest.raises(ValueError, match="contiguous float32"):
        hopper._row_stats_descriptor(randn(256, 6, device="cpu").t(), 64)
    with pytest.raises(ValueError, match="contiguous float32"):
        hopper._row_stats_descriptor(lse.double(), 64)


TILES = [HopperTiles(consumers=2, block_n=128, stages=3), HopperTiles(consumers=3, block_n=128, stages=3),
         HopperTiles(consumers=2, block_n=64, stages=4), HopperTiles(consumers=3, block_n=64, stages=3)]


@requires_hopper
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"c{t.consumers}-n{t.block_n}-s{t.stages}")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("b, h, n, d", [(1, 2, 128, 64), (2, 3, 384, 64), (1, 2, 640, 128), (1, 1, 1024, 64)],
                         ids=str)
def test_matches_float64(tiles, layout, causal, dtype, b, h, n, d):
    if d == 128 and tiles.block_n == 128 and tiles.consumers == 3:
        pytest.skip("3 query and 6 key/value tiles of 128 x 128 take 240 KB of shared memory; an SM has 227")
    q, k, v = make_qkv(b, h, n, d, dtype, layout, seed=n + d)
    scale = d ** -0.5
    o = torch.full_like(q, float("nan"))  # every element must be written
    lse = torch.full((b, h, n), float("nan"), device=DEVICE)
    hopper.forward(q, k, v, o, lse, causal, scale, tiles)
    o_ref, lse_ref = reference(q, k, v, causal, scale)
    assert o.stride() == q.stride()
    assert rel(o, o_ref) <= TOLERANCE[dtype], rel(o, o_ref)
    assert (lse.cpu().double() - lse_ref).abs().max().item() < 1e-4


@requires_hopper
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("h, h_kv", [(4, 2), (6, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_forward_matches_float64(layout, causal, h, h_kv, d):
    """Query head i reads key/value head i // (h / h_kv): against float64 over K and V repeated per group."""
    b, n, dtype = 2, 384, torch.bfloat16
    q = make_qkv(b, h, n, d, dtype, layout, seed=d)[0]
    k, v = make_qkv(b, h_kv, n, d, dtype, layout, seed=d + 7)[:2]
    scale = d ** -0.5
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n), float("nan"), device=DEVICE)
    hopper.forward(q, k, v, o, lse, causal, scale)
    group = h // h_kv
    o_ref, lse_ref = reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal, scale)
    assert rel(o, o_ref) <= TOLERANCE[dtype], rel(o, o_ref)
    assert (lse.cpu().double() - lse_ref).abs().max().item() < 1e-4


@requires_hopper
def test_gqa_through_flash_runs_the_hopper_kernels(hopper_at_every_size, monkeypatch):
    calls = record_hopper_calls(monkeypatch)
    q = make_qkv(2, 4, 256, 64, torch.bfloat16, "bshd", seed=5)[0].requires_grad_()
    k, v = (t.requires_grad_() for t in make_qkv(2, 2, 256, 64, torch.bfloat16, "bshd", seed=6)[:2])
    o = flash_attention(q, k, v, True, 0.125)
    do = randn(*o.shape, seed=9, dtype=torch.bfloat16)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert calls == ["forward", "backward"]
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    o64, _ = attention64(q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), True, 0.125)
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o64, *grads64)):
        assert rel(got, want) <= 2e-2, name


@requires_hopper
def test_flash_runs_it_unless_triton_is_asked_for(hopper_at_every_size, monkeypatch):
    calls = []
    real = hopper.forward
    monkeypatch.setattr(hopper, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make_qkv(2, 4, 512, 64, torch.bfloat16, "bshd", seed=3)  # batch 2: a size-1 dim's stride is free
    o_hopper, lse_hopper = flash_forward(q, k, v, True, 0.125)
    assert calls == [1]
    with use_kernels("triton"):
        o_triton, lse_triton = flash_forward(q, k, v, True, 0.125)
    assert calls == [1]
    assert o_hopper.stride() == o_triton.stride()  # both in q's memory order
    torch.testing.assert_close(o_hopper, o_triton, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_hopper, lse_triton, atol=1e-4, rtol=0)


@requires_hopper
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_through_flash_match_float64(hopper_at_every_size, monkeypatch, compiled):
    calls = record_hopper_calls(monkeypatch)
    torch._dynamo.reset()
    flash = flash_attention
    fn = torch.compile(flash, fullgraph=True) if compiled else flash
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 256, 64, torch.bfloat16, "bshd", seed=5))
    o = fn(q, k, v, True, 0.125)
    do = randn(*o.shape, seed=9, dtype=torch.bfloat16)
    grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-2, -1) * 0.125).masked_fill(torch.ones(256, 256, dtype=torch.bool).triu(1),
                                                           float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ v64
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double())
    assert set(calls) == {"forward", "backward"}, calls
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o64, *grads64)):
        assert rel(got, want) <= 2e-2, name


BACKWARD_TILES = [
    {"dkdv": HopperTiles(2, 64, 4), "dq": HopperTiles(2, 64, 3)},
    {"dkdv": HopperTiles(2, 32, 4), "dq": HopperTiles(3, 64, 3)},
    {"dkdv": HopperTiles(3, 64, 2), "dq": HopperTiles(2, 128, 3)},
]

def _tiles_id(tiles):
    return "-".join(f"{k}c{t.consumers}n{t.block_n}s{t.stages}" for k, t in tiles.items())


def _backward_smem(t: HopperTiles, d: int) -> int:
    return (2 * t.rows + 2 * t.stages * t.block_n) * d * 2  # two resident and two streamed bf16 tiles


def gradients_reference(q, k, v, do, causal, scale):
    """(o, lse, dq, dk, dv) in float64 on the CPU."""
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    o64, lse64 = attention64(q64, k64, v64, causal, scale)
    return (o64.detach(), lse64.detach(), *torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double()))


@requires_hopper
@pytest.mark.parametrize("tiles", BACKWARD_TILES, ids=_tiles_id)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("b, h, n, d", [(1, 2, 128, 64), (2, 3, 384, 64), (1, 2, 640, 128), (1, 1, 1024, 64)],
                         ids=str)
def test_backward_matches_float64(tiles, layout, causal, dtype, b, h, n, d):
    if any(_backward_smem(t, d) > 227 * 1024 for t in tiles.values()):
        pytest.skip("these tiles take more shared memory than an SM has at d 128")
    q, k, v = make_qkv(b, h, n, d, dtype, layout, seed=n + d)
    other = "bhsd" if layout == "bshd" else "bshd"  # dO arrives in its own memory order
    do = make_qkv(b, h, n, d, dtype, other, seed=7 * n)[0]
    scale = d ** -0.5
    o64, lse64, *grads64 = gradients_reference(q, k, v, do, causal, scale)
    o = o64.to(DEVICE, dtype)
    lse = lse64.to(DEVICE, torch.float32).contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # every element must be written
    hopper.backward(q, k, v, do, lse, delta, dq, dk, dv, causal, scale, tiles)
    for name, got, want, like in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64, (q, k, v)):
        assert got.stride() == like.stride(), name
        assert rel(got, want) <= TOLERANCE[dtype], (name, rel(got, want))


# QUERY_HEAD_PROGRAMS_MIN that runs a dK/dV program per query head with GQA (True), or per key/value head (False)
QUERY_HEAD_PROGRAMS = {True: hopper_inputs.QUERY_HEAD_PROGRAMS_AT_EVERY_SIZE,
                       False: hopper_inputs.QUERY_HEAD_PROGRAMS_NEVER}


@requires_hopper
@pytest.mark.parametrize("tiles", BACKWARD_TILES[:2], ids=_tiles_id)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("h, h_kv", [(4, 2), (6, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("per_query_head", [False, True], ids=["kv-head programs", "query-head programs"])
def test_gqa_backward_matches_float64(monkeypatch, tiles, layout, causal, h, h_kv, d, per_query_head):
    """dK and dV of a key/value head sum its group's query heads: one program streams them in turn or, as large
    groups of long sequences (QUERY_HEAD_PROGRAMS_MIN), a program per query head writes its share, summed after;
    bitwise reproducible either way."""
    if any(_backward_smem(t, d) > 227 * 1024 for t in tiles.values()):
        pytest.skip("these tiles take more shared memory than an SM has at d 128")
    monkeypatch.setattr(hopper_inputs, "QUERY_HEAD_PROGRAMS_MIN", QUERY_HEAD_PROGRAMS[per_query_head])
    b, n, dtype = 2, 384, torch.bfloat16
    q = make_qkv(b, h, n, d, dtype, layout, seed=d)[0]
    k, v = make_qkv(b, h_kv, n, d, dtype, layout, seed=d + 7)[:2]
    do = make_qkv(b, h, n, d, dtype, layout, seed=d + 11)[0]
    scale = d ** -0.5
    lse, delta, grads64 = backward_inputs64(q, k, v, do, causal, scale)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # every element must be written
    hopper.backward(q, k, v, do, lse, delta, dq, dk, dv, causal, scale, tiles)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64):
        assert rel(got, want) <= TOLERANCE[dtype], (name, rel(got, want))
    again = [torch.empty_like(t) for t in (q, k, v)]
    hopper.backward(q, k, v, do, lse, delta, *again, causal, scale, tiles)
    assert all(torch.equal(a, g) for a, g in zip(again, (dq, dk, dv)))  # deterministic


@requires_hopper
def test_flash_backward_runs_it_unless_triton_is_asked_for(hopper_at_every_size, monkeypatch):
    calls = []
    real = hopper.backward
    monkeypatch.setattr(hopper, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make_qkv(2, 4, 512, 64, torch.bfloat16, "bshd", seed=3)
    do = randn(2, 4, 512, 64, seed=4, dtype=torch.bfloat16)
    o, lse = flash_forward(q, k, v, True, 0.125)
    hopper_grads = flash_backward(q, k, v, o, lse, do, True, 0.125)
    assert calls == [1]
    with use_kernels("triton"):
        triton_grads = flash_backward(q, k, v, o, lse, do, True, 0.125)
    assert calls == [1]
    for got, want in zip(hopper_grads, triton_grads):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    deterministic = [flash_backward(q, k, v, o, lse, do, True, 0.125, deterministic=True) for _ in range(2)]
    assert calls == [1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(*deterministic)), "the deterministic backward is not deterministic"
    for got, want in zip(hopper_grads, deterministic[0]):  # the default at d 64 is the fused backward
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@requires_hopper
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fused"])
def test_backward_replays_in_a_cuda_graph(hopper_at_every_size, deterministic):
    """Deterministic, dQ runs on a second stream: a captured backward must fork and join it, and replay to the eager
    result bitwise. Fused, the replay zeroes the dQ accumulator again before adding into it."""
    q, k, v = make_qkv(2, 4, 512, 64, torch.bfloat16, "bhsd", seed=11)
    do = randn(2, 4, 512, 64, seed=12, dtype=torch.bfloat16)
    o, lse = flash_forward(q, k, v, True, 0.125)
    eager = flash_backward(q, k, v, o, lse, do, True, 0.125, deterministic=deterministic)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch.cuda.graphs asks
        flash_backward(q, k, v, o, lse, do, True, 0.125, deterministic=deterministic)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_backward(q, k, v, o, lse, do, True, 0.125, deterministic=deterministic)
    for _ in range(2):  # a second replay would see the first's dQ if the accumulator were not zeroed again
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@requires_hopper
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("h, h_kv, n", [(4, 4, 384), (4, 1, 512), (6, 2, 256), (2, 2, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("per_query_head", [False, True], ids=["kv-head programs", "query-head programs"])
def test_fused_backward_matches_float64(monkeypatch, layout, causal, h, h_kv, n, dtype, d, per_query_head):
    """The fused backward (the dK/dV kernel adds dQ with TMA reductions; at d 128 each consumer its half of d): every
    gradient element written, each within the deterministic backward's tolerance of float64, MHA and GQA; GQA with a
    dK/dV program per key/value head or, as large groups of long sequences (QUERY_HEAD_PROGRAMS_MIN), per query head
    (its shares of dK and dV summed after)."""
    if per_query_head and h == h_kv:
        pytest.skip("MHA has one query head per key/value head")
    monkeypatch.setattr(hopper_inputs, "QUERY_HEAD_PROGRAMS_MIN", QUERY_HEAD_PROGRAMS[per_query_head])
    b, scale = 2, d ** -0.5
    q = make_qkv(b, h, n, d, dtype, layout, seed=n + h)[0]
    k, v = make_qkv(b, h_kv, n, d, dtype, layout, seed=n + 7)[:2]
    do = make_qkv(b, h, n, d, dtype, layout, seed=n + 11)[0]
    lse, delta, grads64 = backward_inputs64(q, k, v, do, causal, scale)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # every element must be written
    acc = torch.zeros(hopper.accumulator_shape(q), dtype=torch.float32, device=q.device)
    hopper.backward(q, k, v, do, lse, delta, *grads, causal, scale, dq_acc=acc)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads64):
        assert got.stride() == {"dq": q, "dk": k, "dv": v}[name].stride()
        assert rel(got, want) <= TOLERANCE[dtype], (name, rel(got, want))


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_long_gqa_sums_query_head_shares_in_plans_and_graphs(hopper_at_every_size, monkeypatch, d, deterministic):
    """Where QUERY_HEAD_PROGRAMS_MIN says, the backward of GQA sums each query head's share of dK and dV: on the
    first call, from flash's plan on the second, and replayed from a CUDA graph; fused within the tolerance of the
    deterministic backward with a program per key/value head, deterministic bitwise equal on all three."""
    monkeypatch.setattr(hopper_inputs, "QUERY_HEAD_PROGRAMS_MIN", dict.fromkeys(hopper_inputs.MODES,
                                                                              {"group": 4, "seq": 512}))
    monkeypatch.setattr(dispatch, "_plans", {})  # plans made under another rule
    sums = []
    real = hopper.sum_shares
    monkeypatch.setattr(hopper, "sum_shares", lambda *a: sums.append(1) or real(*a))
    flash = get_attention("flash")
    q = make_qkv(2, 8, 512, d, torch.bfloat16, "bshd", seed=d)[0].requires_grad_()
    k, v = (t.requires_grad_() for t in make_qkv(2, 2, 512, d, torch.bfloat16, "bshd", seed=d + 3)[:2])
    do = randn(2, 8, 512, d, seed=5, dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(deterministic)
    try:
        runs = [torch.autograd.grad(flash(q, k, v, causal=True), (q, k, v), do) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert sums == [1, 1]  # the second call ran its plan
    detached = [t.detach() for t in (q, k, v)]
    args = (*detached, *flash_forward(*detached, True, d ** -0.5), do, True, d ** -0.5)
    kwargs = dict(deterministic=deterministic)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch.cuda.graphs asks
        flash_backward(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_backward(*args, **kwargs)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert len(sums) == 4
    if deterministic:
        for got in (runs[1], captured):
            assert all(torch.equal(g, w) for g, w in zip(got, runs[0]))
    monkeypatch.setattr(hopper_inputs, "QUERY_HEAD_PROGRAMS_MIN", QUERY_HEAD_PROGRAMS[False])
    dispatch._plans.clear()
    torch.use_deterministic_algorithms(True)
    try:
        want = torch.autograd.grad(flash(q, k, v, causal=True), (q, k, v), do)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(sums) == 4  # a program per key/value head: nothing to sum
    for got in (*runs, captured):
        for g, w in zip(got, want):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@requires_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_flash_runs_the_fused_backward_unless_deterministic_algorithms_are_on(hopper_at_every_size, monkeypatch, d):
    """Through get_attention("flash"): fused by default, the two bitwise-reproducible kernels under
    torch.use_deterministic_algorithms(True), whose two backward passes agree bitwise."""
    modes = []
    real = hopper.backward
    recording = lambda *a, **kw: modes.append(kw.get("dq_acc") is not None) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(hopper, "backward", recording)
    flash = get_attention("flash")
    inputs = [t.requires_grad_() for t in make_qkv(2, 4, 512, d, torch.bfloat16, "bshd", seed=d)]
    do = randn(2, 4, 512, d, seed=5, dtype=torch.bfloat16)
    default = torch.autograd.grad(flash(*inputs, causal=True), inputs, do)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(flash(*inputs, causal=True), inputs, do) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert modes == [True, False]  # the second deterministic call ran its plan
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for got, want in zip(default, runs[0]):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@requires_hopper
def test_short_problems_take_the_hopper_kernels_only_when_replayed(monkeypatch):
    """Below MIN_SCORES eager calls keep the Triton kernels; a captured call takes the Hopper backward (any size) and
    the Hopper forward at d 128, and its replay gives what the eager call gave."""
    from attention.flash import dispatch
    from attention import get_attention, graph_replay

    calls = []
    for name in ("forward", "backward"):
        real = getattr(hopper, name)
        monkeypatch.setattr(hopper, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    flash = get_attention("flash")
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 256, 128, torch.bfloat16, "bshd", seed=21))
    do = randn(2, 4, 256, 128, seed=22, dtype=torch.bfloat16)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        out = flash(q, k, v, causal=True)
        out.backward(do)
        return out

    # Detached: a live eager graph would keep AccumulateGrad nodes made on the default stream, which a capture
    # cannot wait on.
    eager = [fwd_bwd().detach(), q.grad, k.grad, v.grad]
    assert calls == []  # 2 * 4 * 256^2 / 2 scores: far below MIN_SCORES
    with graph_replay():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the Hopper kernels compile here, not during the capture
            fwd_bwd()
        torch.cuda.current_stream().wait_stream(side)
        assert calls == ["forward", "backward"]
        calls.clear()
        q.grad = k.grad = v.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash(q, k, v, causal=True)
            out.backward(do)
    # The capture launched the Hopper kernels through the plans the warm-up resolved (attention/flash/dispatch.py).
    assert calls == [] and any(isinstance(plan, hopper.ForwardPlan) and backward and all(
        isinstance(b, hopper.BackwardPlan) for b in backward.values()) for plan, backward in dispatch._plans.values())
    replayed = [out.detach(), q.grad, k.grad, v.grad]  # detach: the same memory, without the autograd view rules
    for t in replayed:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------------
# Windows and documents (with GQA): the masked tiles, the skipped ones, the per-consumer ranges
# ----------------------------------------------------------------------------------------------------------


def visible64(n, causal, window, doc_ids):
    """(batch, 1, n, n) bool: which keys each query sees, written out from the definitions."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (i - j < window) if causal else ((i - j).abs() < window)
    keep = keep.expand(doc_ids.shape[0] if doc_ids is not None else 1, n, n)
    if doc_ids is not None:
        ids = doc_ids.cpu()
        keep = keep & (ids[:, :, None] == ids[:, None, :])
    return keep[:, None]


MASK_CASES = {  # name: (causal, window, documents as (shortest, longest) lengths or None)
    "window1": (True, 1, None),
    "window63": (True, 63, None),
    "window200-full": (False, 200, None),
    "window-over-seq": (True, 5000, None),
    "docs": (True, None, (1, 300)),
    "docs-of-1": (True, None, (1, 1)),
    "one-doc-full": (False, None, (5000, 5000)),
    "docs-full": (False, None, (50, 400)),
    "window100-docs": (True, 100, (30, 500)),
}
THREE_CONSUMERS = {"fwd": HopperTiles(3, 128, 3), "bwd": {"dkdv": HopperTiles(2, 64, 4), "dq": HopperTiles(3, 64, 4)}}


def test_masks_hand_the_kernels_document_bounds():
    q = torch.zeros(2, 3, 8, 16)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    masks = hopper.Masks.of(q, 4, doc_ids)
    assert masks.starts.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0] * 8]
    assert masks.ends.tolist() == [[3, 3, 3, 5, 5, 8, 8, 8], [8] * 8]
    assert masks.starts.dtype == torch.int32 and masks.constexprs() == {"window": True, "docs": True}
    assert masks.arguments(q)[2] == 4
    dummy = torch.zeros(1)
    assert hopper.Masks.of(q, None, None).arguments(dummy) == (dummy, dummy, 0)
    assert hopper.NO_MASKS.constexprs() == {"window": False, "docs": False}


@requires_hopper
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("h, h_kv, per_query_head", [(4, 4, False), (4, 2, False), (4, 1, False), (4, 2, True)],
                         ids=["(4, 4)", "(4, 2)", "(4, 1)", "(4, 2) query-head programs"])
@pytest.mark.parametrize("d, tiles", [(64, None), (64, "three"), (128, None)], ids=["d64", "d64-c3", "d128"])
def test_masked_forward_and_backward_match_float64(monkeypatch, case, h, h_kv, per_query_head, d, tiles):
    """Windows and documents, alone and together, causal and not, with GQA (a dK/dV program per key/value head, or
    per query head): O, L, dQ, dK, dV against float64, the backward deterministic."""
    monkeypatch.setattr(hopper_inputs, "QUERY_HEAD_PROGRAMS_MIN", QUERY_HEAD_PROGRAMS[per_query_head])
    causal, window, docs = MASK_CASES[case]
    b, n, dtype, scale = 2, 640, torch.bfloat16, d ** -0.5
    doc_ids = None if docs is None else random_doc_ids(b, n, *docs, seed=n + h_kv)
    q = make_qkv(b, h, n, d, dtype, "bshd", seed=d + h_kv)[0]
    k, v = make_qkv(b, h_kv, n, d, dtype, "bshd", seed=d + 3)[:2]
    do = make_qkv(b, h, n, d, dtype, "bhsd", seed=d + 5)[0]
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    group = h // h_kv
    s = q64 @ k64.repeat_interleave(group, 1).transpose(-2, -1) * scale
    s = s.masked_fill(~visible64(n, causal, window, doc_ids), float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ v64.repeat_interleave(group, 1)
    lse64 = torch.logsumexp(s, dim=-1)
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double())

    masks = hopper.Masks.of(q, window, doc_ids)
    fwd_tiles = THREE_CONSUMERS["fwd"] if tiles else None
    bwd_tiles = THREE_CONSUMERS["bwd"] if tiles else None
    o = torch.full_like(q, float("nan"))  # every element must be written
    lse = torch.full((b, h, n), float("nan"), device=DEVICE)
    hopper.forward(q, k, v, o, lse, causal, scale, fwd_tiles, masks)
    assert rel(o, o64) <= TOLERANCE[dtype], rel(o, o64)
    assert (lse.cpu().double() - lse64.detach()).abs().max().item() < 1e-4

    o_in = o64.detach().to(DEVICE, dtype)
    lse_in = lse64.detach().to(DEVICE, torch.float32).contiguous()
    delta = (do.float() * o_in.float()).sum(-1).contiguous()
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    hopper.backward(q, k, v, do, lse_in, delta, *grads, causal, scale, bwd_tiles, masks)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads64):
        if want.norm() == 0:  # every row sees itself alone (a window of 1, documents of 1): dQ is exactly 0
            assert got.abs().max().item() < 1e-5, name
        else:
            assert rel(got, want) <= TOLERANCE[dtype], (name, rel(got, want))
    again = [torch.empty_like(t) for t in (q, k, v)]
    hopper.backward(q, k, v, do, lse_in, delta, *again, causal, scale, bwd_tiles, masks)
    assert all(torch.equal(a, g) for a, g in zip(again, grads))  # deterministic


@requires_hopper
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("h, h_kv", [(8, 8), (8, 2)], ids=str)
@pytest.mark.parametrize("consumers", [2, 3])
def test_the_persistent_forward_is_the_forward_of_a_program_per_item(case, h, h_kv, consumers):
    """With several work items to a program (here 2 * 8 * 16 or 11 items on at most 132 programs), each of its own
    number of key tiles, the persistent forward gives bitwise the O and L of a program per item."""
    causal, window, docs = MASK_CASES[case]
    b, n, d, dtype = 2, 2048, 64, torch.bfloat16
    doc_ids = None if docs is None else random_doc_ids(b, n, *docs, seed=n + h_kv)
    q = make_qkv(b, h, n, d, dtype, "bshd", seed=h_kv)[0]
    k, v = make_qkv(b, h_kv, n, d, dtype, "bshd", seed=7)[:2]
    masks = hopper.Masks.of(q, window, doc_ids)
    outputs = []
    for persistent in (False, True):
        o = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, n), float("nan"), device=DEVICE)
        hopper.forward(q, k, v, o, lse, causal, d ** -0.5, HopperTiles(consumers, 64, 4, persistent=persistent),
                       masks)
        outputs.append((o, lse))
    (o, lse), (o_p, lse_p) = outputs
    assert not o.isnan().any()
    assert torch.equal(o, o_p) and torch.equal(lse, lse_p)


@requires_hopper
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("window, docs", [(96, True), (4096, False)], ids=["window96-docs", "window4096"])
def test_masked_attention_through_flash_runs_the_hopper_kernels(hopper_at_every_size, monkeypatch, compiled, window,
                                                                docs):
    """The registry's flash with a window, and packed documents (doc_ids broadcast over two leading dims), takes the
    Hopper kernels, eager and compiled; it matches float64."""
    calls = record_hopper_calls(monkeypatch)
    torch._dynamo.reset()
    flash = torch.compile(flash_attention, fullgraph=True) if compiled else flash_attention
    n = 512
    doc_ids = random_doc_ids(1, n, 20, 300, seed=3)[0] if docs else None  # (n,): the same in every sequence
    q = randn(2, 3, 4, n, 64, seed=5, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(2, 3, 2, n, 64, seed=s, dtype=torch.bfloat16).requires_grad_() for s in (6, 7))
    o = flash(q, k, v, True, 0.125, window, None, doc_ids)
    do = randn(*o.shape, seed=9, dtype=torch.bfloat16)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert sorted(set(calls)) == ["backward", "forward"], calls
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.repeat_interleave(2, 2).transpose(-2, -1) * 0.125
    s = s.masked_fill(~visible64(n, True, window, None if doc_ids is None else doc_ids[None])[0], float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ v64.repeat_interleave(2, 2)
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.cpu().double())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o64, *grads64)):
        assert rel(got, want) <= 2e-2, name


@requires_hopper
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_signature_seen_before_runs_its_hopper_plan(monkeypatch, layout):
    """The second eager call of a signature the Hopper kernels run launches the resolved kernels with the first
    call's descriptors pointed at its tensors, and gives bitwise what the general path gives."""
    from attention.flash import dispatch
    from attention import get_attention, graph_replay

    flash = get_attention("flash")
    with graph_replay():  # the Hopper forward and backward at any size at d 128
        first = [t.requires_grad_() for t in make_qkv(2, 4, 256, 128, torch.bfloat16, layout, seed=0)]
        o = flash(*first, causal=True)
        torch.autograd.grad(o, first, randn(*o.shape, seed=3, dtype=torch.bfloat16))
        (plan, backward_plans), = dispatch._plans.values()
        assert isinstance(plan, hopper.ForwardPlan)
        assert [type(p) for p in backward_plans.values()] == [hopper.BackwardPlan]
        inputs = [t.requires_grad_() for t in make_qkv(2, 4, 256, 128, torch.bfloat16, layout, seed=10)]
        do = randn(*o.shape, seed=20, dtype=torch.bfloat16)
        o_ref, lse = flash_forward(*(t.detach() for t in inputs), True, 128 ** -0.5)
        expected = (o_ref, *flash_backward(*(t.detach() for t in inputs), o_ref, lse, do, True, 128 ** -0.5))

        def refused(*args, **kwargs):
            raise AssertionError("the general path ran for a signature that has a plan")

        for name in ("forward", "backward", "_descriptor"):
            monkeypatch.setattr(hopper, name, refused)
        o = flash(*inputs, causal=True)
        planned = (o, *torch.autograd.grad(o, inputs, do))
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))


@requires_hopper
def test_documents_run_through_the_hopper_plan_with_each_calls_bounds(monkeypatch):
    """With documents, the second call of a signature runs its plans (at this size the Triton forward's, the Hopper
    backward's) with its own documents' bounds, and gives bitwise what the general path gives for those documents."""
    from attention.flash import dispatch
    from attention import get_attention, graph_replay

    flash = get_attention("flash")
    n = 256
    with graph_replay():  # the Hopper backward at any size
        first = [t.requires_grad_() for t in make_qkv(2, 4, n, 64, torch.bfloat16, "bhsd", seed=0)]
        for _ in range(2):  # the first call of a new shape autotunes the Triton forward, the second resolves it
            o = flash(*first, causal=True, doc_ids=random_doc_ids(2, n, 1, 100, seed=1))
            torch.autograd.grad(o, first, randn(*o.shape, seed=3, dtype=torch.bfloat16))
        (_, backward_plans), = dispatch._plans.values()
        assert [type(p) for p in backward_plans.values()] == [hopper.BackwardPlan]
        inputs = [t.requires_grad_() for t in make_qkv(2, 4, n, 64, torch.bfloat16, "bhsd", seed=10)]
        doc_ids = random_doc_ids(2, n, 1, 100, seed=2)
        do = randn(*o.shape, seed=20, dtype=torch.bfloat16)
        detached = [t.detach() for t in inputs]
        o_ref, lse = flash_forward(*detached, True, 0.125, doc_ids=doc_ids)
        expected = (o_ref, *flash_backward(*detached, o_ref, lse, do, True, 0.125, doc_ids=doc_ids))

        def refused(*args, **kwargs):
            raise AssertionError("the general path ran for a signature that has a plan")

        for name in ("forward", "backward", "_descriptor"):
            monkeypatch.setattr(hopper, name, refused)
        o = flash(*inputs, causal=True, doc_ids=doc_ids)
        planned = (o, *torch.autograd.grad(o, inputs, do))
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))


@requires_hopper
def test_plans_keep_no_tensor_of_their_calls_alive():
    """Once a call's outputs are dropped, the memory in use is what it was before the call: the plans it made (first
    call) or ran (second) hold none of its tensors in their descriptors."""
    from attention.flash import dispatch
    from attention import get_attention, graph_replay

    flash = get_attention("flash")
    with graph_replay():  # the Hopper forward and backward at any size at d 128
        for seed in (0, 1):
            inputs = [t.requires_grad_() for t in make_qkv(2, 4, 256, 128, torch.bfloat16, "bhsd", seed=seed)]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            o = flash(*inputs, causal=True)
            grads = torch.autograd.grad(o, inputs, randn(*o.shape, seed=seed + 2, dtype=torch.bfloat16))
            del o, grads
            torch.cuda.synchronize()
            # The autograd engine's device thread lets go of the graph's saved tensors shortly after grad() returns:
            # wait for that, not for anything that holds them for good.
            deadline = time.monotonic() + 5
            while torch.cuda.memory_allocated() != before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert torch.cuda.memory_allocated() == before, f"call {seed + 1}"
    (plan, backward_plans), = dispatch._plans.values()
    assert isinstance(plan, hopper.ForwardPlan) and len(backward_plans) == 1
