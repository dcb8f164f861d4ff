import pytest
import torch

from attention import UnknownBackendError, UnsupportedInputError, get_attention, list_attention, why_not

CPU_BACKENDS = [row.name for row in list_attention() if row.available]


def backends(slow: set[str]) -> list:
    """CPU_BACKENDS as parameters, those named in `slow` marked slow (torch.compile takes seconds a shape on a CPU,
    FlexAttention's more)."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in CPU_BACKENDS]


def reference(q, k, v, causal, scale):
    """softmax(q k^T * scale) v in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("backend", backends(slow={"compiled", "flex"}))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 17, 16), (1, 33, 32), (4, 1, 64)])
def test_backends_match_float64_reference(backend, causal, shape):
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    if why_not(backend, q, k, v, causal):
        pytest.skip(why_not(backend, q, k, v, causal))
    scale = shape[-1] ** -0.5
    out = get_attention(backend)(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, causal, scale)
    rq, rk, rv = torch.autograd.grad(ref, (qr, kr, vr), grad.double())
    for got, want in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


# The compiled backend's full case is the fast set's one Inductor compile (2 s on 2 CPU cores); its causal case (10 s
# or more) and FlexAttention's (15 s) run with -m slow.
@pytest.mark.parametrize("causal, backend", [
    pytest.param(causal, name, id=f"{causal}-{name}",
                 marks=[pytest.mark.slow] if name == "flex" or (name == "compiled" and causal) else [])
    for causal in (False, True) for name in CPU_BACKENDS])
def test_forward_matches_reference_without_grad(backend, causal):
    q, k, v = (torch.randn(2, 2, 31, 32) for _ in range(3))
    with torch.no_grad():
        if why_not(backend, q, k, v, causal):
            pytest.skip(why_not(backend, q, k, v, causal))
        out = get_attention(backend)(q, k, v, causal=causal)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal, 32**-0.5), atol=1e-4, rtol=1e-4)


def test_custom_scale_is_used():
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    out = get_attention("sdpa")(q, k, v, causal=False, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, False, 0.3), atol=1e-5, rtol=1e-5)


def test_unknown_backend_lists_valid_names():
    with pytest.raises(UnknownBackendError, match=r"unknown attention backend 'nope'.*naive.*sdpa"):
        get_attention("nope")


def test_list_attention_says_why_a_backend_cannot_run():
    rows = {r.name: r for r in list_attention()}
    assert {"naive", "compiled", "sdpa", "flex"} <= set(rows)
    assert rows["naive"].available and rows["naive"].reason is None
    if not torch.cuda.is_available():
        assert not rows["sdpa-cudnn"].available and "CUDA" in rows["sdpa-cudnn"].reason


@pytest.mark.parametrize(
    "shapes, dtypes, match",
    [
        (((2, 8, 16), (2, 8, 16), (2, 9, 16)), None, "k and v must have the same shape"),
        (((2, 8, 16), (2, 8, 32), (2, 8, 32)), None, "share d_head"),
        (((2, 8, 16), (3, 8, 16), (3, 8, 16)), None, "share leading dims"),
        (((16,), (16,), (16,)), None, r"\(\.\.\., seq, d_head\)"),
        (((2, 8, 16),) * 3, (torch.float32, torch.float64, torch.float32), "share a dtype"),
    ],
)
def test_bad_inputs_name_the_problem(shapes, dtypes, match):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes))
    with pytest.raises(UnsupportedInputError, match=match):
        get_attention("naive")(q, k, v)


def test_causal_needs_equal_lengths():
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    get_attention("naive")(q, k, v, causal=False)  # fine without the mask
    with pytest.raises(UnsupportedInputError, match="equal query and key lengths"):
        get_attention("naive")(q, k, v, causal=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_gpu_only_backend_says_why():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(UnsupportedInputError, match="'sdpa-flash' cannot run this input: needs a CUDA GPU"):
        get_attention("sdpa-flash")(q, q, q)


def test_graph_replay_blocks_nest_and_close_on_errors():
    from attention.registry import graph_replay, graph_replay_requested, launches_replayed

    assert not graph_replay_requested() and not launches_replayed()
    with graph_replay():
        with graph_replay():
            assert graph_replay_requested() and launches_replayed()
        assert graph_replay_requested()
        with pytest.raises(RuntimeError, match="boom"):
            with graph_replay():
                raise RuntimeError("boom")
        assert graph_replay_requested()
    assert not graph_replay_requested() and not launches_replayed()


def test_compiled_code_guards_on_graph_replay_requested():
    from attention.registry import graph_replay, graph_replay_requested

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1 if graph_replay_requested() else x - 1, backend="eager", fullgraph=True)
    x = torch.randn(3)
    assert torch.equal(compiled(x), x - 1)
    with graph_replay():
        assert torch.equal(compiled(x), x + 1)
    assert torch.equal(compiled(x), x - 1)


def test_checks_run_once_per_call_signature(monkeypatch):
    """A signature the checks passed is not checked again; anything they read makes another signature, and an input
    they refuse is refused every time."""
    from attention import registry

    checked = []

    def input_check(q, k, v, causal):
        checked.append(tuple(q.shape))
        return "d_head 8 is refused" if q.shape[-1] == 8 else None

    monkeypatch.setitem(registry._BACKENDS, "counting", registry.Backend(
        "counting", lambda q, k, v, causal, scale, **variant: q * scale, "counts its checks", input_check=input_check,
        variants=frozenset(registry.VARIANTS)))
    attend = get_attention("counting")
    q = torch.randn(2, 3, 16, 4)
    for _ in range(3):
        torch.testing.assert_close(attend(q, q, q, causal=True, scale=2.0), q * 2)
    assert len(checked) == 1
    calls = [dict(q=q[:1], k=q[:1], v=q[:1]), dict(causal=False), dict(window=3), dict(softcap=2.0),
             dict(q=q.double(), k=q.double(), v=q.double()), dict(q=q.clone().requires_grad_())]
    for n, change in enumerate(calls, start=2):
        args = {"q": q, "k": q, "v": q, "causal": True, **change}
        attend(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        attend(**{"q": q, "k": q, "v": q, "causal": True, **change})
        assert len(checked) == n, change
    with torch.no_grad():  # whether gradients are wanted: FlexAttention refuses a CPU backward
        attend(q.clone().requires_grad_(), q, q, causal=True)
    assert len(checked) == len(calls) + 2
    attend(q, q, q, causal=True, doc_ids=torch.zeros(16, dtype=torch.long))  # documents: checked on every call
    attend(q, q, q, causal=True, doc_ids=torch.zeros(16, dtype=torch.long))
    assert len(checked) == len(calls) + 4
    small = torch.randn(1, 1, 4, 8)
    for _ in range(2):
        with pytest.raises(UnsupportedInputError, match="d_head 8 is refused"):
            attend(small, small, small)
    with pytest.raises(UnsupportedInputError, match="window must be an integer"):
        attend(q, q, q, causal=True, window=0)
