"""GQA/MQA, sliding windows, packed documents and logit softcap, in every backend that runs them.

Each backend's output and gradients are compared with a float64 reference written here, from the definitions in
attention/registry.py, not with the project's naive backend. On the CPU, flash runs in the Triton interpreter, which
is slow: flash gets a covering set of cases (each variant alone, causal and not, and combined), the cheap backends
all of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from attention import UnsupportedInputError, flash_kernels, get_attention, list_attention, why_not

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# bf16 is wrong in the Triton interpreter; on a GPU the variants run in bf16 as in training.
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def reference(q, k, v, causal: bool, scale: float, window: Optional[int], softcap: Optional[float],
              doc_ids: Optional[torch.Tensor], do: torch.Tensor):
    """(o, dq, dk, dv) in float64 on the CPU: K and V repeated per query head, every score computed, then masked."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    s = q @ k.repeat_interleave(group, dim=-3).transpose(-2, -1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    seen = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= (i - j < window) if causal else ((i - j).abs() < window)
    if doc_ids is not None:
        ids = doc_ids.cpu()
        seen = seen & (ids[..., :, None] == ids[..., None, :])[..., None, :, :]  # a head dim
    o = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ v.repeat_interleave(group, dim=-3)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do.cpu().double()))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return ((got - want).norm() / max(want.norm().item(), 1e-2 * math.sqrt(want.numel()))).item()


def documents(batch: int, n: int, kind: str, seed: int = 0) -> torch.Tensor:
    """doc_ids (batch, n): "len1" every position its own document, "one" a single document, "mean<L>" random runs
    of mean length L (different per sequence)."""
    if kind == "len1":
        return torch.arange(n).expand(batch, n).contiguous()
    if kind == "one":
        return torch.zeros(batch, n, dtype=torch.long)
    mean = int(kind.removeprefix("mean"))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, n, generator=gen) < 1.0 / mean
    return torch.cumsum(starts.long(), dim=-1) + 7  # ids need not start at 0


@dataclass(frozen=True)
class Case:
    id: str
    batch: int
    h_q: int
    h_kv: int
    n_q: int
    d: int
    causal: bool
    window: Optional[int] = None
    softcap: Optional[float] = None
    docs: Optional[str] = None
    n_k: Optional[int] = None
    flat_docs: bool = False  # doc_ids (n,) for every sequence, not (batch, n)
    on_flash: bool = True  # also run under the interpreter (keep these few: it is slow)

    def inputs(self, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(0)
        n_k = self.n_k or self.n_q

        def one(h, n):
            return torch.randn(self.batch, h, n, self.d, generator=gen).to(DEVICE, dtype).requires_grad_()

        q, k, v = one(self.h_q, self.n_q), one(self.h_kv, n_k), one(self.h_kv, n_k)
        doc_ids = None
        if self.docs is not None:
            doc_ids = documents(1 if self.flat_docs else self.batch, self.n_q, self.docs)
            doc_ids = (doc_ids[0] if self.flat_docs else doc_ids).to(DEVICE)
        return q, k, v, {"window": self.window, "softcap": self.softcap, "doc_ids": doc_ids}


CASES = [
    # GQA / MQA alone: groups of 2 and h_q (MQA); groups of 1 are every other test of the backends
    Case("gqa2-causal-s100", 1, 4, 2, 100, 16, True),
    Case("mqa-full-s17", 2, 2, 1, 17, 32, False, on_flash=False),
    Case("mqa-full-q100-k17", 1, 3, 1, 100, 16, False, n_k=17),
    # windows of 1, 2, 63 and longer than the sequence
    Case("win1-causal-s100", 1, 1, 1, 100, 16, True, window=1),
    Case("win2-full-q17-k100", 1, 2, 2, 17, 16, False, window=2, n_k=100),
    Case("win63-causal-s257", 1, 1, 1, 257, 16, True, window=63),
    Case("win63-full-s100", 1, 1, 1, 100, 32, False, window=63, on_flash=False),
    Case("win300-full-s100", 1, 1, 1, 100, 16, False, window=300),
    # softcap
    Case("cap1.5-causal-s100", 1, 2, 2, 100, 32, True, softcap=1.5),
    Case("cap1.5-full-q17-k100", 1, 1, 1, 17, 16, False, softcap=1.5, n_k=100, on_flash=False),
    # documents of length 1, one spanning everything, random
    Case("docs-len1-causal-s17", 2, 1, 1, 17, 16, True, docs="len1"),
    Case("docs-one-full-s100", 1, 1, 1, 100, 16, False, docs="one", on_flash=False),
    Case("docs-mean20-causal-s100", 2, 2, 2, 100, 16, True, docs="mean20"),
    Case("docs-mean20-full-s100-flat", 2, 1, 1, 100, 16, False, docs="mean20", flat_docs=True),
    Case("docs-len1-full-s17", 1, 2, 2, 17, 16, False, docs="len1", on_flash=False),
    # combined
    Case("all-causal-s257", 1, 2, 1, 257, 16, True, window=63, softcap=3.0, docs="mean40"),
    Case("gqa2-win17-cap-full-s100", 1, 4, 2, 100, 16, False, window=17, softcap=2.0),
    Case("mqa-win2-docs-full-s100", 1, 2, 1, 100, 16, False, window=2, docs="mean20", on_flash=False),
    Case("win-gt-seq-docs-one-causal-s100", 1, 2, 1, 100, 32, True, window=1000, docs="one", on_flash=False),
]
# The backends that run on the CPU, forward and backward, besides flash.
CHEAP_BACKENDS = ["naive", "flash-torch", "sdpa"]


def check(backend: str, case: Case, dtype: torch.dtype, backward: bool = True) -> None:
    q, k, v, variant = case.inputs(dtype)
    if not backward:
        q, k, v = (t.detach() for t in (q, k, v))
    with torch.set_grad_enabled(backward):
        reason = why_not(backend, q, k, v, case.causal, **variant)
        if reason is not None:
            pytest.skip(reason)
        o = get_attention(backend)(q, k, v, causal=case.causal, **variant)
    scale = 1.0 / math.sqrt(case.d)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want = reference(q, k, v, case.causal, scale, variant["window"], variant["softcap"], variant["doc_ids"], do)
    got = (o, *torch.autograd.grad(o, (q, k, v), do)) if backward else (o,)
    errors = {name: rel_error(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    bad = {name: e for name, e in errors.items() if not e <= TOLERANCE[dtype]}
    assert not bad, f"relative error above {TOLERANCE[dtype]}: {bad}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
def test_backends_match_float64(backend, case):
    check(backend, case, torch.float32)


FLASH_CASES = [c for c in CASES if c.on_flash or CUDA]


def scores(case: Case) -> int:
    return case.batch * case.h_q * case.n_q * (case.n_k or case.n_q)


# In the interpreter a case of more than 20000 scores takes a second or more: those run with -m slow.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if scores(c) > 20000 else [])
                                  for c in FLASH_CASES])
def test_flash_matches_float64(case, dtype):
    check("flash", case, dtype)


# One compile each, 15-20 s on the CPU: every variant at once there, each alone on a GPU. With GQA on a GPU, length
# 128: flex refuses GQA at other lengths there (test_flex_says_why_it_refuses_gqa_at_ragged_lengths).
FLEX_N = 128 if CUDA else 100
FLEX_CASES = [Case(f"all-causal-s{FLEX_N}", 1, 4, 2, FLEX_N, 16, True, window=17, softcap=2.0, docs="mean20")] + (
    [dataclasses.replace(c, n_q=128) if c.h_kv < c.h_q else c for c in CASES
     if c.id in ("gqa2-causal-s100", "win63-causal-s257", "cap1.5-causal-s100", "docs-mean20-causal-s100")]
    if CUDA else [])


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("case", FLEX_CASES, ids=[c.id for c in FLEX_CASES])
def test_flex_matches_float64(case):
    # FlexAttention has no backward on the CPU.
    check("flex", case, DTYPES[-1] if CUDA else torch.float32, backward=CUDA)


@pytest.mark.skipif(not CUDA, reason="a limit of FlexAttention's CUDA kernel")
def test_flex_says_why_it_refuses_gqa_at_ragged_lengths():
    q, k = torch.randn(1, 4, 100, 32, device=DEVICE), torch.randn(1, 2, 100, 32, device=DEVICE)
    assert "not multiples of 128, got 100 and 100" in why_not("flex", q, k, k, True)
    assert why_not("flex", q, q, q, True) is None  # without GQA it runs
    q, k = torch.randn(1, 4, 128, 32, device=DEVICE), torch.randn(1, 2, 128, 32, device=DEVICE)
    assert why_not("flex", q, k, k, True) is None


@pytest.mark.slow  # torch.compile
def test_compiled_runs_every_variant():
    # Forward only: compiling the backward too costs half a minute of the CPU test time.
    check("compiled", Case("all", 1, 2, 1, 40, 16, True, window=9, softcap=3.0, docs="mean10"), torch.float32,
          backward=CUDA)


@pytest.mark.slow  # torch.compile
def test_flash_under_torch_compile_matches_eager():
    case = CASES[[c.id for c in CASES].index("docs-mean20-causal-s100")]
    q, k, v, variant = case.inputs(torch.float32)
    k, v = (t[:, :1].detach().requires_grad_() for t in (k, v))  # GQA too
    flash = get_attention("flash")
    variant["window"], variant["softcap"] = 33, 4.0

    def grads(fn):
        o = fn(q, k, v)
        return (o, *torch.autograd.grad(o.square().sum(), (q, k, v)))

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash(q, k, v, causal=True, **variant), fullgraph=True)
    for got, want in zip(grads(compiled), grads(lambda q, k, v: flash(q, k, v, causal=True, **variant))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two backward passes of 40000 scores in the interpreter
def test_flash_backward_with_gqa_is_bitwise_deterministic():
    case = Case("d", 1, 4, 1, 100, 16, True, window=40, docs="mean20")
    q, k, v, variant = case.inputs(torch.float32)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    flash = get_attention("flash")
    first, second = (torch.autograd.grad(flash(q, k, v, causal=True, **variant), (q, k, v), do) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_flash_writes_every_gradient_element():
    """Keys that no query sees (a non-causal window shorter than the key overhang) get dK = dV = 0, written."""
    from attention.flash.common import nan_filled_outputs

    case = Case("w", 1, 2, 1, 17, 16, False, window=5, n_k=100)
    q, k, v, variant = case.inputs(torch.float32)
    with nan_filled_outputs():
        o = get_attention("flash")(q, k, v, causal=False, **variant)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    for name, t in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name} has elements the kernels never wrote"
    assert (dk[..., 21:, :] == 0).all() and (dv[..., 21:, :] == 0).all()


def test_softcap_runs_on_the_triton_kernels():
    q = torch.zeros(1, 8, 8192, 64, dtype=torch.bfloat16, device=DEVICE)  # 2^28 causal scores: enough
    choice = flash_kernels(q, q, q, True, capability=(9, 0), softcap=30.0, window=8)
    assert (choice.forward, choice.backward) == ("triton", "triton")
    for reason in (choice.forward_reason, choice.backward_reason):
        assert "every variant but softcap" in reason


@pytest.mark.parametrize("variant, forward, backward", [
    ("gqa", "hopper", "hopper"), ("window 1024", "hopper", "hopper"), ("window 4096", "hopper", "hopper"),
    ("window 64", "triton", "triton"), ("doc_ids", "hopper", "hopper"), ("doc_ids, replayed", "hopper", "hopper"),
    ("gqa, window 4096, doc_ids, replayed", "hopper", "hopper")])
def test_the_other_variants_take_the_hopper_kernels(variant, forward, backward):
    """The Hopper kernels run every variant but softcap, where they compute enough scores (a window counts the pairs
    of its band; documents, unknown on the host, count as without them). Each choice says why."""
    q = torch.zeros(1, 16, 16384, 64, dtype=torch.bfloat16, device=DEVICE)  # 2^31 causal scores
    k = torch.zeros(1, 4 if "gqa" in variant else 16, 16384, 64, dtype=torch.bfloat16, device=DEVICE)
    kwargs = {}
    if "window" in variant:
        kwargs["window"] = int(variant.split("window ")[1].split(",")[0])
    if "doc_ids" in variant:
        kwargs["doc_ids"] = torch.arange(16384, device=DEVICE) // 1000
    choice = flash_kernels(q, k, k, True, capability=(9, 0), replayed="replayed" in variant, **kwargs)
    assert (choice.forward, choice.backward) == (forward, backward), choice
    if "doc_ids" in variant:
        for reason in (choice.forward_reason, choice.backward_reason):
            assert reason.startswith("hopper: sm_90, bf16, d 64, "), reason
    if variant == "window 64":  # 16 heads * 16384 rows * (64 + 128) keys
        for reason, bound in ((choice.forward_reason, "2^28"), (choice.backward_reason, "2^27")):
            assert f"50331648 scores are too few for the Hopper kernels: below {bound}" in reason
    if variant == "window 1024":
        for reason in (choice.forward_reason, choice.backward_reason):
            assert "hopper: sm_90, bf16, d 64, 301989888 scores" in reason


def test_list_attention_names_the_variants_of_each_backend():
    rows = {r.name: r for r in list_attention()}
    assert set(rows["naive"].variants) == set(rows["flash"].variants) == {"gqa", "window", "softcap", "doc_ids"}
    assert set(rows["sdpa"].variants) == {"gqa", "window", "doc_ids"}
    assert rows["sdpa-flash"].variants == ("gqa",)


def _qkv(n=16, h_q=2, h_kv=2):
    return torch.randn(1, h_q, n, 16), torch.randn(1, h_kv, n, 16), torch.randn(1, h_kv, n, 16)


@pytest.mark.parametrize("shapes, variant, causal, message", [
    ((8, 3, 2), {}, True, r"q's heads \(dim -3\) are a multiple of k's"),
    ((8, 2, 2), {"window": 0}, True, "window must be an integer >= 1, got 0"),
    ((8, 2, 2), {"window": 2.0}, True, "window must be an integer >= 1"),
    ((8, 2, 2), {"window": True}, True, "window must be an integer >= 1"),
    ((8, 2, 2), {"softcap": 0.0}, True, "softcap must be a finite number > 0"),
    ((8, 2, 2), {"softcap": float("inf")}, True, "softcap must be a finite number > 0"),
    ((8, 2, 2), {"doc_ids": torch.zeros(8)}, True, "doc_ids must be an integer tensor, got a torch.float32"),
    ((8, 2, 2), {"doc_ids": torch.zeros(7, dtype=torch.long)}, True, r"broadcastable to .*\(1, 8\), got shape \(7,\)"),
    ((8, 2, 2), {"doc_ids": torch.zeros(3, 8, dtype=torch.long)}, True, "broadcastable"),
    ((8, 2, 2), {"doc_ids": torch.tensor([0, 0, 1, 1, 0, 2, 2, 2])}, True, "non-decreasing"),
])
def test_bad_variants_name_the_problem(shapes, variant, causal, message):
    n, h_q, h_kv = shapes
    q, k, v = _qkv(n, h_q, h_kv)
    for backend in ("naive", "flash-torch", "flash"):
        with pytest.raises(UnsupportedInputError, match=message):
            get_attention(backend)(q, k, v, causal=causal, **variant)
        assert why_not(backend, q, k, v, causal, **variant) is not None


@pytest.mark.parametrize("name", ["flash", "flash-torch"])
def test_doc_ids_changed_between_forward_and_backward_are_refused(name):
    q, k, v = (t.to(DEVICE).requires_grad_() for t in _qkv(40, 2, 2))
    doc_ids = torch.tensor([0] * 20 + [1] * 20, device=DEVICE)
    o = get_attention(name)(q, k, v, causal=True, doc_ids=doc_ids)
    doc_ids.add_(1)  # a loader reusing its buffer for the next batch
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_numpy_numbers_are_numbers():
    q, k, v = _qkv(17, 4, 2)
    expected = get_attention("naive")(q, k, v, causal=True, window=4, softcap=2.5)
    got = get_attention("naive")(q, k, v, causal=True, window=np.int64(4), softcap=np.float32(2.5))
    torch.testing.assert_close(got, expected)


def test_the_sdpa_mask_is_counted_for_every_sequence_it_is_broadcast_to():
    """doc_ids shared by q's first leading dim still gives one mask per sequence: 2 * 3 of them here."""
    from attention.masks import mask_elements

    doc_ids = torch.zeros(3, 16, dtype=torch.long)
    assert mask_elements(16, 16, doc_ids, (2, 3)) == 2 * 3 * 16 * 16
    assert mask_elements(16, 16, None, (2, 3)) == 16 * 16  # without documents one mask serves all


def test_documents_need_self_attention_and_windows_need_a_key_per_query():
    q, k = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 5, 16)
    with pytest.raises(UnsupportedInputError, match="doc_ids is for self-attention"):
        get_attention("naive")(q, k, k, doc_ids=torch.zeros(8, dtype=torch.long))
    with pytest.raises(UnsupportedInputError, match="queries 6.. of 8 would see no key of 5"):
        get_attention("naive")(q, k, k, window=2)
    get_attention("naive")(q, k, k, window=4)  # query 7 sees key 4


def test_backends_say_which_variant_they_lack(monkeypatch):
    from attention import sdpa

    q, k, v = _qkv()
    assert why_not("sdpa", q, k, v, True, softcap=30.0).endswith("it does not support logit soft-capping")
    assert why_not("sdpa", q, k, v, True, window=4) is None
    monkeypatch.setattr(sdpa, "MAX_MASK_ELEMENTS", 100)
    assert "materialised boolean mask" in why_not("sdpa", q, k, v, True, window=4)
    with pytest.raises(UnsupportedInputError, match="'sdpa' cannot run this input: windows and documents need"):
        get_attention("sdpa")(q, k, v, causal=True, doc_ids=torch.zeros(16, dtype=torch.long))
