"""Shared pieces of the flash tests: the interpreter switch, the float64 reference and the shape cases.

Without a GPU the Triton kernels run in the CPU interpreter, which must be switched on before the
kernels load (attention/flash/triton/host.py imports them on first use) and before `attention` is imported, which
defines flash's operators for the interpreter or the GPU (attention/flash/api.py). tests/conftest.py sets it first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def no_eager_plans(monkeypatch):
    """Each test starts without the eager plans of flash (attention/flash/dispatch.py) that earlier tests made: a
    signature seen before would run its plan and skip the choice of kernels that tests record."""
    from attention.flash import dispatch

    monkeypatch.setattr(dispatch, "_plans", {})


@pytest.fixture
def hopper_at_every_size(monkeypatch):
    """Eager calls take flash's Hopper kernels at any size, where they take the input at all, and the fused backward
    wherever it takes the input (no window or documents)."""
    from attention.flash.hopper import inputs

    monkeypatch.setattr(inputs, "MIN_SCORES", inputs.min_scores_at_every_head_dim(0, 0))
    monkeypatch.setattr(inputs, "FUSED_MIN", inputs.FUSED_AT_EVERY_SIZE)


def dtype_id(dtype: torch.dtype) -> str:
    """A dtype as a test id: torch.float16 -> float16."""
    return str(dtype).removeprefix("torch.")


def randn(*shape, dtype=torch.float32, seed=0, device=DEVICE) -> torch.Tensor:
    """Fresh standard-normal values from their own seeded generator, drawn on the CPU (the same on any device)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def random_doc_ids(b: int, n: int, shortest: int, longest: int, seed: int, device=DEVICE) -> torch.Tensor:
    """(b, n) int32 non-decreasing ids: documents of random lengths in [shortest, longest]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        lengths = torch.randint(shortest, longest + 1, (n,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(n, dtype=torch.int32), lengths)[:n])
    return torch.stack(rows).to(device)

# Relative Frobenius error allowed against float64, by input dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-10}


@dataclass(frozen=True)
class FlashCase:
    """One attention problem: q is lead + (n_q, d), k and v lead + (n_k, d)."""

    id: str
    lead: tuple[int, ...]
    n_q: int
    n_k: int
    d: int
    causal: bool
    scale: Optional[float] = None
    transposed: bool = False  # q, k, v are (b, s, h, d) tensors transposed to (b, h, s, d): non-contiguous

    def make_qkv(self, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)

        def one(n: int) -> torch.Tensor:
            if self.transposed:
                b, h = self.lead
                t = torch.randn(b, n, h, self.d, generator=gen).to(device, dtype).transpose(1, 2)
                assert not t.is_contiguous()
            else:
                t = torch.randn(*self.lead, n, self.d, generator=gen).to(device, dtype)
            return t.requires_grad_()

        return one(self.n_q), one(self.n_k), one(self.n_k)

    @property
    def resolved_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.d)


def _case(id, lead, n, d, causal, **kw) -> FlashCase:
    n_q, n_k = (n, n) if isinstance(n, int) else n
    return FlashCase(id, lead, n_q, n_k, d, causal, **kw)


# A covering set, not the cartesian product (the interpreter is slow): every seq with a couple of head
# dims and every head dim with a couple of seqs, causal and not, 2/3/4/5-d inputs, a transposed view,
# q_len != k_len, a non-default scale, and seqs that are exact tile multiples (the unmasked paths only).
FLASH_CASES = [
    _case("s1-d16-causal-4d", (1, 2), 1, 16, True),
    _case("s1-d64-3d", (2,), 1, 64, False),
    _case("s17-d48-causal-3d", (2,), 17, 48, True),
    _case("s17-d128-4d", (1, 2), 17, 128, False),
    _case("s100-d64-causal-4d", (1, 2), 100, 64, True),
    _case("s100-d80-4d", (2, 1), 100, 80, False),
    _case("s100-d128-causal-4d", (1, 1), 100, 128, True),
    _case("s257-d16-causal-3d", (2,), 257, 16, True),
    _case("s257-d80-causal-4d", (1, 1), 257, 80, True),
    _case("s257-d48-4d", (1, 1), 257, 48, False),
    _case("s128-d64-causal-4d", (1, 2), 128, 64, True),
    _case("s128-d16-4d", (1, 1), 128, 16, False),
    _case("s33-d256-causal-4d", (1, 1), 33, 256, True),
    _case("q100-k37-d48-4d", (1, 2), (100, 37), 48, False),
    _case("q17-k100-d80-3d", (1,), (17, 100), 80, False),
    _case("s100-d64-causal-transposed", (1, 2), 100, 64, True, transposed=True),
    _case("s50-d32-causal-5d", (2, 1, 2), 50, 32, True),
    _case("s40-d16-2d", (), 40, 16, False),
    _case("s100-d64-scale0.3", (1, 2), 100, 64, False, scale=0.3),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Any test taking `flash_case` runs once per FLASH_CASES entry.
    if "flash_case" in metafunc.fixturenames:
        metafunc.parametrize("flash_case", FLASH_CASES, ids=[c.id for c in FLASH_CASES])


def attention_reference(q, k, v, causal: bool, scale: float, do: torch.Tensor):
    """(o, lse, dq, dk, dv) by the naive formula in float64 on the CPU, gradients by autograd."""
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) * scale  # (..., n_q, n_k)
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.softmax(scores, dim=-1) @ v64
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), do.detach().cpu().double())
    return o.detach(), lse.detach(), dq, dk, dv


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, with a floor on ||ref|| of 1e-2 RMS per element (gradients can be ~0)."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    floor = 1e-2 * math.sqrt(ref.numel())
    return ((out - ref).norm() / max(ref.norm().item(), floor)).item()


def check_against_reference(impl: Callable, case: FlashCase, dtype: torch.dtype, device: torch.device) -> None:
    """Run impl(q, k, v, causal, scale) forward and backward and compare o, L, dq, dk, dv with float64."""
    q, k, v = case.make_qkv(dtype, device)
    o = impl(q, k, v, case.causal, case.scale)
    saved_lse = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved_lse) == 1, "exactly one saved tensor must have L's shape q.shape[:-1]"
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    ref = attention_reference(q, k, v, case.causal, case.resolved_scale, do)
    tol = TOLERANCE[dtype]
    errors = {
        name: relative_error(got, want)
        for name, got, want in zip(("o", "L", "dq", "dk", "dv"), (o, saved_lse[0], dq, dk, dv), ref)
    }
    assert o.dtype == dtype and saved_lse[0].dtype in (torch.float32, torch.float64)
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"relative error above {tol}: {bad}"


def check_every_element_written(function: type[torch.autograd.Function], causal: bool, n_q: int, n_k: int) -> None:
    """`function.apply` forward and backward with every output starting as NaN: o, L, dq, dk and dv must have no NaN
    left, so the kernels wrote every element."""
    from attention.flash.common import empty, nan_filled_outputs

    q = randn(1, 2, n_q, 80, seed=0).requires_grad_()
    k, v = (randn(1, 2, n_k, 80, seed=s).requires_grad_() for s in (1, 2))
    with nan_filled_outputs():
        assert empty((2,), torch.float32, DEVICE).isnan().all(), "outputs must start as NaN"
        o = function.apply(q, k, v, causal)
        (lse,) = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
        grads = torch.autograd.grad(o, (q, k, v), randn(*o.shape, seed=3))
    for name, t in zip(("o", "L", "dq", "dk", "dv"), (o, lse, *grads)):
        assert not t.isnan().any(), f"{name} has {int(t.isnan().sum())} elements the kernels never wrote"


def check_saved_tensors_are_linear_in_seq(function: type[torch.autograd.Function]) -> None:
    """`function.apply` saves only O(seq * d_head) tensors for backward, L (fp32) the one shaped q.shape[:-1]."""
    lead, n, d = (1, 2), 257, 16  # n * n = 66049 > n * d = 4112: an O(seq^2) tensor would not fit the bound
    q, k, v = (randn(*lead, n, d, seed=s).requires_grad_() for s in range(3))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = function.apply(q, k, v, True)
    bound = math.prod(lead) * n * d
    assert saved, "nothing was saved for backward"
    for t in saved:
        assert t.numel() <= bound, f"saved tensor of shape {tuple(t.shape)} exceeds O(seq * d_head)"
    lse_like = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(lse_like) == 1 and lse_like[0].dtype == torch.float32


# Test modules cannot import from a conftest reliably, so the helpers travel as fixtures.


@pytest.fixture(name="check_saved_tensors_are_linear_in_seq")
def _check_saved_tensors_are_linear_in_seq() -> Callable[[type], None]:
    return check_saved_tensors_are_linear_in_seq


@pytest.fixture(name="check_every_element_written")
def _check_every_element_written() -> Callable[[type, bool, int, int], None]:
    return check_every_element_written


@pytest.fixture
def check_flash() -> Callable[[Callable, FlashCase, torch.dtype, torch.device], None]:
    return check_against_reference


@pytest.fixture
def flash_reference() -> Callable:
    return attention_reference


@pytest.fixture
def rel_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return relative_error


@pytest.fixture
def tolerance() -> dict[torch.dtype, float]:
    return TOLERANCE
