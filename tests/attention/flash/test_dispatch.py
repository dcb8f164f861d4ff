"""attention/flash/dispatch.py: which of flash's kernels run an input, and why (attention.flash_kernels, that is
attention.flash.choose_kernels), and the eager plans: the second call of an input signature launches what the first
resolved.

The decision itself is tested on any machine by asking it for an sm_90 GPU (`capability=(9, 0)`); on an sm_90 GPU
test_long_causal_bf16_runs_the_hopper_kernels_on_sm90 checks that what it says is what runs.
"""

from __future__ import annotations

import math

import pytest
import torch

import attention
from attention import UnsupportedInputError, flash_kernels, get_attention, use_kernels
from attention.flash import KernelChoice, dispatch, flash_backward, flash_forward
from attention.flash.hopper import host as hopper, inputs as hopper_inputs
from attention.flash.triton import host as flash_triton
from tests.attention.conftest import random_doc_ids, randn

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0) and hopper_inputs.gluon_problem() is None
requires_gluon = pytest.mark.skipif(hopper_inputs.gluon_problem() is not None, reason="needs triton's Gluon")
SM90 = (9, 0)


def qkv(b, h, n, d, dtype=torch.bfloat16, device="cuda" if CUDA else "cpu"):
    # On a GPU machine the tensors are CUDA ones: flash refuses CPU tensors there (no interpreter).
    return [torch.zeros(b, h, n, d, dtype=dtype, device=device) for _ in range(3)]


SHORT = (1, 2, 256, 64)  # 2^16 causal scores: host time decides
LONG = (1, 16, 8192, 64)  # 2^29 causal scores
SEQ_1000 = (1, 16, 1000, 64)  # not whole 128-row tiles


def test_choice_is_exported_next_to_why_not():
    assert attention.flash_kernels is attention.flash.choose_kernels
    choice = flash_kernels(*qkv(*SHORT, dtype=torch.float32), causal=True)
    assert isinstance(choice, KernelChoice)
    assert str(choice) == f"forward {choice.forward_reason}; backward {choice.backward_reason}"


@pytest.mark.skipif(CUDA, reason="the answer for CPU tensors")
@pytest.mark.parametrize("shape", [SHORT, LONG, SEQ_1000], ids=["short", "long", "seq1000"])
def test_cpu_tensors_run_the_triton_kernels(shape):
    choice = flash_kernels(*qkv(*shape, dtype=torch.float32), causal=True)
    assert (choice.forward, choice.backward) == ("triton", "triton")
    assert choice.forward_reason == "triton: the Hopper kernels need CUDA tensors"


TOO_FEW = "triton: 2^16 scores are too few for the Hopper kernels: below {} host time outweighs the faster kernels"


@requires_gluon
@pytest.mark.parametrize("shape, dtype, kernel, reason", [
    (SHORT, torch.bfloat16, "triton", (TOO_FEW.format("2^28"), TOO_FEW.format("2^27"))),
    (LONG, torch.bfloat16, "hopper", ("hopper: sm_90, bf16, d 64, 2^29 scores (at least 2^28)",
                                      "hopper: sm_90, bf16, d 64, 2^29 scores (at least 2^27)")),
    (SEQ_1000, torch.bfloat16, "triton",
     "triton: the Hopper kernels need a sequence that is a multiple of 128, got 1000"),
    (LONG, torch.float32, "triton", "triton: the Hopper kernels take float16 and bfloat16, not torch.float32"),
], ids=["short", "long", "seq1000", "fp32"])
def test_choice_for_an_sm90_gpu(shape, dtype, kernel, reason):
    choice = flash_kernels(*qkv(*shape, dtype=dtype), causal=True, capability=SM90)
    forward_reason, backward_reason = reason if isinstance(reason, tuple) else (reason, reason)
    mode = "; " + dispatch.FUSED if kernel == "hopper" else ""  # the Hopper backward says which mode it runs
    assert choice == KernelChoice(kernel, kernel, forward_reason, backward_reason + mode)


@requires_gluon
@pytest.mark.parametrize("shape, forward, backward", [
    ((1, 16, 4096, 64), "triton", "hopper"),  # 2^27 scores
    ((16, 12, 1024, 64), "triton", "triton"),  # 3 * 2^25
    ((8, 16, 2048, 64), "hopper", "hopper"),  # 2^28
    ((8, 16, 1024, 128), "hopper", "hopper"),  # 2^26
    ((8, 32, 512, 128), "triton", "triton"),  # 2^25
], ids=["d64-2^27", "d64-3x2^25", "d64-2^28", "d128-2^26", "d128-2^25"])
def test_eager_calls_take_each_hopper_pass_from_its_own_size(shape, forward, backward):
    """Eager, a Hopper pass runs where its faster kernel outweighs its launch's extra host time: at d 64 the backward
    from fewer scores than the forward, at d 128 both from fewer than at d 64."""
    choice = flash_kernels(*qkv(*shape), causal=True, capability=SM90, replayed=False)
    assert (choice.forward, choice.backward) == (forward, backward), choice


@requires_gluon
@pytest.mark.parametrize("d, window, asked, fused", [
    (64, None, None, True), (64, None, True, False), (64, None, False, True), (128, None, None, True),
    (128, None, True, False), (64, 1024, None, False)],
    ids=["d64", "d64-deterministic-call", "d64-fast-call", "d128", "d128-deterministic-call", "d64-window"])
@pytest.mark.parametrize("torch_deterministic", [False, True], ids=["torch-default", "torch-deterministic"])
def test_backward_mode_follows_torch_deterministic_algorithms(d, window, asked, fused, torch_deterministic):
    """The Hopper backward runs fused (dQ added with atomics) without a window or documents, unless deterministic
    algorithms are asked for: by torch.use_deterministic_algorithms, or by the call, whose own answer wins."""
    inputs = qkv(1, 16, 8192, d)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_deterministic)
    try:
        choice = flash_kernels(*inputs, causal=True, capability=SM90, replayed=True, window=window,
                               deterministic=asked)
    finally:
        torch.use_deterministic_algorithms(saved)
    assert choice.backward == "hopper"
    fused = fused and not (torch_deterministic and asked is None)
    assert choice.backward_reason.endswith(dispatch.FUSED if fused else ")")
    if not fused:
        why = ("deterministic algorithms asked for" if asked or (torch_deterministic and asked is None) else
               "the fused backward takes no window or documents")
        assert dispatch.DETERMINISTIC in choice.backward_reason and why in choice.backward_reason


@requires_gluon
def test_the_backward_says_why_it_runs_the_two_kernels_where_they_are_the_faster():
    """Replayed, a short d-128 problem and a GQA one whose dK/dV programs are few run the deterministic pair without
    being asked to, and the reason says why; a long one runs fused."""
    short = flash_kernels(*qkv(8, 4, 512, 128), causal=True, capability=SM90, replayed=True)
    assert short.backward_reason.endswith(f"{dispatch.DETERMINISTIC} (faster than the fused backward below 2048 keys "
                                          "at d 128)"), short
    q, k, v = qkv(1, 64, 2048, 128)[0], *qkv(1, 8, 2048, 128)[:2]
    gqa = flash_kernels(q, k, v, causal=True, capability=SM90, replayed=True)
    assert gqa.backward_reason.endswith("(faster than the fused backward's 128 dK/dV programs, under 4 waves of "
                                        f"{hopper_inputs.sm_count_of(q)} SMs)"), gqa
    assert flash_kernels(*qkv(4, 16, 2048, 128), causal=True, capability=SM90,
                         replayed=True).backward_reason.endswith(dispatch.FUSED)


@requires_gluon
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_long_gqa_of_large_groups_says_it_runs_a_program_per_query_head(deterministic):
    """GQA groups of 8 or more run a dK/dV program per query head in the fused backward from 4096 keys, and say so;
    of 16 or more in the deterministic one from 2048; smaller groups keep a program per key/value head."""
    mode = (f"{dispatch.DETERMINISTIC} (deterministic algorithms asked for)" if deterministic else dispatch.FUSED)
    group = 16 if deterministic else 8
    q = qkv(1, 64, 4096, 128)[0]
    large = flash_kernels(q, *qkv(1, 64 // group, 4096, 128)[:2], causal=True, capability=SM90, replayed=True,
                          deterministic=deterministic)
    assert large.backward_reason.endswith(f"{mode}; a dK/dV program per query head, the heads' shares of dK and dV "
                                          f"summed after (GQA groups of {group} or more from "
                                          f"{2048 if deterministic else 4096} keys)"), large
    small = flash_kernels(q, *qkv(1, 128 // group, 4096, 128)[:2], causal=True, capability=SM90, replayed=True,
                          deterministic=deterministic)
    assert "per query head" not in small.backward_reason, small


def test_other_gpus_run_the_triton_kernels():
    choice = flash_kernels(*qkv(*LONG), causal=True, capability=(8, 0))
    assert choice.forward == choice.backward == "triton"
    assert choice.forward_reason == "triton: the Hopper kernels need an sm_90 (Hopper) GPU, this is sm_80"


@requires_gluon
def test_replayed_launches_take_the_hopper_kernels_on_short_problems():
    """Replayed from a CUDA graph only GPU time counts: the backward takes any size, the forward at d 128, and at
    d 64 from 2^27 scores."""
    d128 = flash_kernels(*qkv(1, 2, 256, 128), causal=True, capability=SM90, replayed=True)
    assert (d128.forward, d128.backward) == ("hopper", "hopper")
    assert d128.forward_reason == ("hopper: sm_90, bf16, d 128, 2^16 scores "
                                   "(any size, launches replayed from a CUDA graph)")
    d64 = flash_kernels(*qkv(*SHORT), causal=True, capability=SM90, replayed=True)
    assert (d64.forward, d64.backward) == ("triton", "hopper")
    assert "less GPU time" in d64.forward_reason and "replayed" in d64.forward_reason


@requires_gluon
def test_use_kernels_forces_triton():
    inputs = qkv(*LONG)
    with use_kernels("triton"):
        choice = flash_kernels(*inputs, causal=True, capability=SM90)
        with use_kernels("auto"):
            assert flash_kernels(*inputs, causal=True, capability=SM90).forward == "hopper"
    assert (choice.forward, choice.backward) == ("triton", "triton")
    assert choice.forward_reason == "triton: use_kernels('triton') is in effect"
    assert flash_kernels(*inputs, causal=True, capability=SM90).forward == "hopper"  # restored on exit
    assert flash_kernels(*inputs, causal=True, capability=SM90, kernels="triton").backward == "triton"
    with pytest.raises(ValueError, match="kernels must be one of auto, triton"):
        with use_kernels("hopper"):
            pass


def test_backward_choice_looks_at_the_upstream_gradient():
    q, k, v = qkv(*LONG)
    other_order = torch.zeros(1, 8192, 16, 64, dtype=torch.bfloat16, device=q.device).transpose(1, 2)
    if hopper_inputs.gluon_problem() is None:
        assert flash_kernels(q, k, v, causal=True, capability=SM90, do=other_order).backward == "hopper"
    transposed = torch.zeros(1, 16, 64, 8192, dtype=torch.bfloat16, device=q.device).transpose(-2, -1)
    choice = flash_kernels(q, k, v, causal=True, capability=SM90, do=transposed)
    assert choice.backward == "triton" and "need dO in (batch, heads, seq, d)" in choice.backward_reason


def test_input_flash_cannot_run_is_refused():
    with pytest.raises(UnsupportedInputError, match="head dim 8 is not supported"):
        flash_kernels(*qkv(1, 1, 16, 8), causal=True)


def test_the_launches_ask_the_choice(monkeypatch):
    """Eager flash asks the Hopper kernels' conditions through the choice, which use_kernels("triton") settles
    before asking."""
    asked = []
    real = hopper_inputs.forward_problem
    monkeypatch.setattr(hopper_inputs, "forward_problem", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    q, k, v = qkv(1, 2, 40, 32, dtype=torch.float32, device="cuda" if CUDA else "cpu")
    flash = get_attention("flash")
    flash(q, k, v, causal=True)
    assert asked == [1]
    with use_kernels("triton"):
        flash(q, k, v, causal=True)
    assert asked == [1]


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton's Gluon")
def test_long_causal_bf16_runs_the_hopper_kernels_on_sm90(monkeypatch):
    calls = []
    for name in ("forward", "backward"):
        real = getattr(hopper, name)
        monkeypatch.setattr(hopper, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    q, k, v = (torch.randn(*LONG, dtype=torch.bfloat16, device="cuda").requires_grad_() for _ in range(3))
    choice = flash_kernels(q, k, v, causal=True)
    reason = "hopper: sm_90, bf16, d 64, 2^29 scores (at least {})"
    assert choice == KernelChoice("hopper", "hopper", reason.format("2^28"),
                                  reason.format("2^27") + "; " + dispatch.FUSED)
    o = get_attention("flash")(q, k, v, causal=True)
    # A dense upstream gradient: .sum() would hand the backward a stride-0 dO, which the Hopper kernels refuse.
    o.backward(torch.randn_like(o))
    assert calls == ["forward", "backward"]
    short = flash_kernels(*qkv(*SHORT, device="cuda"), causal=True)
    assert short.forward == "triton" and "too few" in short.forward_reason
    assert flash_kernels(*qkv(*SEQ_1000, device="cuda"), causal=True).forward == "triton"


# ----------------------------------------------------------------------------------------------------------
# Eager plans: the second call of an input signature launches what the first resolved
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def triton_kernels():
    """The plans of the Triton kernels, on a Hopper GPU too (test_hopper.py has the Hopper kernels' plans)."""
    with use_kernels("triton"):
        yield


def general_path(inputs, do, causal, **variants):
    """(o, dq, dk, dv) by dispatch's forward and backward, which a call of a signature without a plan runs."""
    q, k, v = (t.detach() for t in inputs)
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = flash_forward(q, k, v, causal, scale, **variants)
    return (o, *flash_backward(q, k, v, o, lse, do, causal, scale, **variants))


PLAN_CASES = {  # name: q, k, v shapes, a transpose of dims 1 and 2 (the (batch, seq, heads, d) layout), variants
    "bhsd-causal": ((2, 3, 40, 16), (2, 3, 40, 16), True, {}, False),
    "bshd-layout": ((2, 40, 3, 16), (2, 40, 3, 16), True, {}, True),
    "3-dims-ragged": ((3, 33, 32), (3, 57, 32), False, {}, False),
    "gqa-window-softcap": ((1, 4, 48, 16), (1, 2, 48, 16), True, {"window": 5, "softcap": 3.0}, False),
}


def _plan_inputs(case: str, seed: int) -> list[torch.Tensor]:
    q_shape, kv_shape, _, _, transposed = PLAN_CASES[case]
    tensors = [randn(*shape, seed=seed + i) for i, shape in enumerate((q_shape, kv_shape, kv_shape))]
    return [(t.transpose(1, 2) if transposed else t).requires_grad_() for t in tensors]


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("case", [pytest.param("bhsd-causal", marks=pytest.mark.slow),
                                  pytest.param("bshd-layout", marks=pytest.mark.slow), "3-dims-ragged",
                                  pytest.param("gqa-window-softcap", marks=pytest.mark.slow)])
def test_a_signature_seen_before_runs_its_plan_with_the_same_results(monkeypatch, case):
    """The first eager calls resolve the launches; the next, on fresh inputs of that signature, runs them without
    the general path, and gives bitwise what the general path gives."""
    _, _, causal, variants, _ = PLAN_CASES[case]
    flash = get_attention("flash")
    first = _plan_inputs(case, seed=0)
    for _ in range(2):  # on a GPU the first call of a new shape autotunes, and the second resolves its launches
        o = flash(*first, causal=causal, **variants)
        torch.autograd.grad(o, first, randn(*o.shape, seed=19))  # the plans are per gradient layout: this one's
    assert len(dispatch._plans) == 1 and len(next(iter(dispatch._plans.values()))[1]) == 1
    inputs = _plan_inputs(case, seed=10)
    do = randn(*o.shape, seed=20)
    expected = general_path(inputs, do, causal, **variants)

    def refused(*args, **kwargs):
        raise AssertionError("the general path ran for a signature that has a plan")

    for module, name in ((flash_triton, "_launch"), (flash_triton, "delta_and_launch"), (dispatch, "forward"),
                         (dispatch, "backward")):
        monkeypatch.setattr(module, name, refused)
    planned = grads_of_flash(lambda q, k, v: flash(q, k, v, causal=causal, **variants), inputs, do)
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))
    assert planned[0].stride() == expected[0].stride() and planned[1].stride() == inputs[0].stride()


def grads_of_flash(fn, inputs, do):
    o = fn(*inputs)
    return (o, *torch.autograd.grad(o, inputs, do))


@pytest.mark.usefixtures("triton_kernels")
def test_each_signature_gets_its_own_plan():
    flash = get_attention("flash")

    def call(*args, **kwargs):  # twice: on a GPU a new shape's first call autotunes, and the second keeps a plan
        for _ in range(2):
            flash(*args, **kwargs)

    q, k, v = (randn(1, 2, 32, 16, seed=s) for s in range(3))
    call(q, k, v, causal=True)
    call(q + 1, k, v, causal=True)  # other values, same signature
    assert len(dispatch._plans) == 1
    other_signatures = [
        dict(q=q[..., :24, :], k=k[..., :24, :], v=v[..., :24, :]),  # shape
        dict(q=q.transpose(-1, -2).contiguous().transpose(-1, -2)),  # strides
        dict(q=q.half(), k=k.half(), v=v.half()),  # dtype
        dict(q=q.new_empty(q.numel() + 1)[1:].view_as(q).copy_(q)),  # 4 bytes off a 16-byte boundary
        dict(causal=False), dict(scale=0.3), dict(window=4), dict(softcap=2.0),
    ]
    for n, change in enumerate(other_signatures, start=2):
        args = {"q": q, "k": k, "v": v, "causal": True, **change}
        call(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert len(dispatch._plans) == n, change
    with use_kernels("auto"):  # the kernel setting is part of the signature
        call(q, k, v, causal=True)
    assert len(dispatch._plans) == len(other_signatures) + 2
    call(q, k, v, causal=True, doc_ids=torch.tensor([0] * 16 + [1] * 16, device=q.device))  # documents
    call(q, k, v, causal=True, doc_ids=torch.tensor([0] * 5 + [1] * 27, device=q.device))  # other ones, same plan
    assert len(dispatch._plans) == len(other_signatures) + 3
    call(q.reshape(1, 1, 2, 32, 16), k.reshape(1, 1, 2, 32, 16), v.reshape(1, 1, 2, 32, 16), causal=True)  # 5 dims
    assert len(dispatch._plans) == len(other_signatures) + 3


@pytest.mark.slow  # flash in the interpreter
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("h, h_kv, window", [(2, 2, None), (4, 2, 6)])
def test_documents_run_through_the_plan_with_each_calls_bounds(monkeypatch, h, h_kv, window):
    """A signature with documents gets a plan like any other; each call's own documents reach its launches, forward
    and backward, bitwise as the general path computes them."""
    flash = get_attention("flash")
    b, n, d = 2, 40, 16

    def inputs(seed):
        return [randn(b, heads, n, d, seed=seed + i).requires_grad_() for i, heads in enumerate((h, h_kv, h_kv))]

    first = inputs(0)
    for _ in range(2):  # on a GPU a new shape's first call autotunes, and the second keeps a plan
        o = flash(*first, causal=True, window=window, doc_ids=random_doc_ids(b, n, 1, 12, seed=1))
        torch.autograd.grad(o, first, randn(*o.shape, seed=19))
    assert len(dispatch._plans) == 1
    q, k, v = inputs(10)
    doc_ids, do = random_doc_ids(b, n, 1, 12, seed=2), randn(*o.shape, seed=20)
    expected = general_path((q, k, v), do, True, window=window, doc_ids=doc_ids)

    def refused(*args, **kwargs):
        raise AssertionError("the general path ran for a signature that has a plan")

    for module, name in ((flash_triton, "_launch"), (flash_triton, "delta_and_launch"), (dispatch, "forward"),
                         (dispatch, "backward")):
        monkeypatch.setattr(module, name, refused)
    planned = grads_of_flash(lambda q, k, v: flash(q, k, v, causal=True, window=window, doc_ids=doc_ids), (q, k, v),
                             do)
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))
    assert len(dispatch._plans) == 1


@pytest.mark.usefixtures("triton_kernels")
def test_the_documents_bounds_are_computed_once_per_doc_ids_tensor(monkeypatch):
    """Calls that pass the same doc_ids tensor (a model's layers) compute its bounds once; a changed tensor (in place,
    or another one) or another sequence length gets its own, and the results stay those of fresh bounds."""
    import gc

    computed = []
    real = dispatch.bounds_of
    monkeypatch.setattr(dispatch, "bounds_of", lambda q, ids: computed.append(ids.tolist()) or real(q, ids))
    flash = get_attention("flash")
    q, k, v = (randn(2, 2, 24, 16, seed=s) for s in range(3))
    doc_ids = random_doc_ids(2, 24, 1, 8, seed=1)

    def check(ids):
        want = flash_triton.forward(q, k, v, True, 0.25, doc_ids=ids)[0]  # its own bounds, fresh
        assert torch.equal(flash(q, k, v, causal=True, doc_ids=ids), want)

    for _ in range(3):
        check(doc_ids)
    assert len(computed) == 1
    doc_ids[:, :12] = doc_ids[:, 12:13]  # in place: one document over the first half
    check(doc_ids)
    check(doc_ids.clone())
    assert computed[1:] == [doc_ids.tolist()] * 2
    flash(q[..., :12, :], k[..., :12, :], v[..., :12, :], causal=True, doc_ids=doc_ids[:, :12])
    check(doc_ids)
    assert len(computed) == 5 and dispatch._last_bounds is not None
    del doc_ids
    gc.collect()
    assert dispatch._last_bounds is None  # the bounds go with their doc_ids


@requires_cuda
@pytest.mark.usefixtures("triton_kernels")
def test_a_captured_call_recomputes_its_documents_bounds_on_replay():
    """A CUDA graph captured after eager calls with the same doc_ids tensor computes the bounds inside the graph, so a
    replay after new ids are copied into that tensor masks with the new documents."""
    flash = get_attention("flash")
    q, k, v = (randn(2, 2, 64, 16, seed=s, dtype=torch.float16) for s in range(3))
    doc_ids = random_doc_ids(2, 64, 1, 20, seed=1)
    flash(q, k, v, causal=True, doc_ids=doc_ids)  # warm: the bounds of these ids are kept
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash(q, k, v, causal=True, doc_ids=doc_ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flash(q, k, v, causal=True, doc_ids=doc_ids)
    new_ids = random_doc_ids(2, 64, 1, 20, seed=2)
    doc_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, flash_forward(q, k, v, True, 0.25, doc_ids=new_ids)[0])
