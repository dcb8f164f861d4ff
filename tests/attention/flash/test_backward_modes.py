"""flash's two backward modes (docs/flash.md, Backward modes): the fast one (dK/dV adds dQ atomically) against a
float64 reference on every variant, the deterministic one bitwise reproducible, and which one a call gets: PyTorch's
torch.use_deterministic_algorithms setting, or the call's deterministic= keyword."""

from __future__ import annotations

import pytest
import torch

from attention import UnsupportedInputError, flash_kernels, get_attention
from attention.flash.triton import host as flash_triton
from tests.attention.conftest import dtype_id
from tests.attention.test_variants import Case, reference, rel_error

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter's bf16 arithmetic is wrong, so bf16 is tested on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}

CASES = [
    Case("causal-s100-d48", 2, 2, 2, 100, 48, True),  # ragged tiles, padded head dim
    Case("full-q100-k37", 1, 2, 2, 100, 32, False, n_k=37),
    Case("gqa2-causal-s100", 1, 4, 2, 100, 16, True),
    Case("mqa-full-q37-k100", 1, 3, 1, 37, 16, False, n_k=100),
    Case("win17-causal-s100", 1, 2, 2, 100, 16, True, window=17),
    Case("win5-full-s70", 1, 1, 1, 70, 16, False, window=5),
    Case("docs-mean20-causal-s100", 2, 2, 2, 100, 16, True, docs="mean20"),
    Case("cap1.5-full-s70", 1, 2, 2, 70, 32, False, softcap=1.5),
    Case("all-gqa2-causal-s130", 1, 4, 2, 130, 16, True, window=40, softcap=3.0, docs="mean40"),
]


@pytest.fixture
def torch_deterministic():
    """torch.use_deterministic_algorithms(True) inside the test, the previous setting after it."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The Triton kernels (host.py names: "fwd", "dq", "dkdv", "fused") launched while the test runs."""
    names = []
    real = flash_triton._launch

    def spy(kernel, *args, **kwargs):
        names.append(kernel)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(flash_triton, "_launch", spy)
    return names


def _grads(case: Case, dtype: torch.dtype, **call) -> tuple:
    """(o, dq, dk, dv) of get_attention("flash") on the case's inputs, and the float64 reference's."""
    q, k, v, variant = case.inputs(dtype)
    o = get_attention("flash")(q, k, v, causal=case.causal, **variant, **call)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want = reference(q, k, v, case.causal, case.d**-0.5, variant["window"], variant["softcap"], variant["doc_ids"],
                     do)
    return (o, *torch.autograd.grad(o, (q, k, v), do)), want


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fast_backward_matches_float64(case, dtype, launched):
    got, want = _grads(case, dtype, deterministic=False)
    if DEVICE.type == "cpu" or case.softcap is not None:  # on a GPU the Hopper backward may take the rest
        assert "fused" in launched and "dq" not in launched
    errors = {name: rel_error(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    bad = {name: e for name, e in errors.items() if not e <= TOLERANCE[dtype]}
    assert not bad, f"relative error above {TOLERANCE[dtype]}: {bad}"


def _kernels_of_one_call(launched: list[str], **call) -> list[str]:
    _grads(CASES[0], torch.float32, **call)
    return launched[1:]  # after the forward


def test_the_fast_backward_is_the_default(launched):
    assert _kernels_of_one_call(launched) == ["fused"]
    choice = flash_kernels(*CASES[0].inputs(torch.float32)[:3], causal=True)
    assert choice.backward_mode == "fast"
    assert choice.mode_reason == "torch.are_deterministic_algorithms_enabled() is False"
    assert "fast backward (dK/dV adds dQ atomically in fp32" in str(choice)


def test_torch_deterministic_algorithms_choose_the_deterministic_backward(torch_deterministic, launched):
    assert _kernels_of_one_call(launched) == ["dq", "dkdv"]
    choice = flash_kernels(*CASES[0].inputs(torch.float32)[:3], causal=True)
    assert choice.backward_mode == "deterministic"
    assert choice.mode_reason == "torch.are_deterministic_algorithms_enabled() is True"


def test_the_call_overrides_torchs_setting(torch_deterministic, launched):
    assert _kernels_of_one_call(launched, deterministic=False) == ["fused"]
    choice = flash_kernels(*CASES[0].inputs(torch.float32)[:3], causal=True, deterministic=False)
    assert (choice.backward_mode, choice.mode_reason) == ("fast", "deterministic=False was passed")


def test_the_call_asks_for_the_deterministic_backward(launched):
    assert _kernels_of_one_call(launched, deterministic=True) == ["dq", "dkdv"]


def test_the_mode_is_decided_when_the_forward_runs(launched):
    """The eager call resolves the mode at the forward, so a backward run after the setting changed keeps it."""
    q, k, v, _ = CASES[0].inputs(torch.float32)
    o = get_attention("flash")(q, k, v, causal=True)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        o.backward(torch.randn_like(o))
    finally:
        torch.use_deterministic_algorithms(saved)
    assert launched == ["fwd", "fused"]


def test_the_hopper_backward_is_deterministic_in_either_mode():
    q, k, v = (torch.zeros(1, 16, 8192, 64, dtype=torch.bfloat16) for _ in range(3))
    choice = flash_kernels(q, k, v, causal=True, capability=(9, 0), deterministic=False)
    if choice.backward != "hopper":
        pytest.skip(choice.backward_reason)
    assert choice.backward_mode == "deterministic"
    assert choice.mode_reason.startswith("deterministic=False was passed, but the Hopper backward is deterministic")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_the_deterministic_backward_is_bitwise_reproducible(dtype, torch_deterministic):
    case = CASES[-1]  # GQA, a window, documents and softcap: every sum over heads and tiles
    q, k, v, variant = case.inputs(dtype)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    flash = get_attention("flash")
    first, second = (torch.autograd.grad(flash(q, k, v, causal=True, **variant), (q, k, v), do) for _ in range(2))
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two backward passes"


def test_other_backends_refuse_the_keyword():
    q, k, v, _ = CASES[0].inputs(torch.float32)
    with pytest.raises(UnsupportedInputError, match="attention backend 'naive' takes no deterministic= argument"):
        get_attention("naive")(q, k, v, causal=True, deterministic=True)


@pytest.mark.slow
def test_compiled_calls_pass_the_mode_to_the_operator(launched):
    """The compiled graph is keyed on the mode: with torch's setting switched on, the backward runs dQ and dK/dV."""
    torch._dynamo.reset()
    flash = get_attention("flash")
    compiled = torch.compile(lambda q, k, v: flash(q, k, v, causal=True), fullgraph=True)
    q, k, v, _ = CASES[0].inputs(torch.float32)
    compiled(q, k, v).sum().backward()
    fast = list(launched)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        launched.clear()
        compiled(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(saved)
    if CUDA:  # Inductor launches the kernels itself
        return
    assert fast == ["fwd", "fused"] and launched == ["fwd", "dq", "dkdv"]
