"""flash's Triton kernels (attention/flash/triton/) against a float64 reference, through the Function eager calls run
and directly; without a GPU they run in the Triton interpreter (conftest.py switches it on). The float64 comparison
runs over conftest.FLASH_CASES."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attention.flash import FlashAttention, Tiles, flash_backward, flash_forward, use_kernels
from attention.flash.common import empty, nan_filled_outputs
from attention.flash.triton import host as flash_triton
from tests.attention.conftest import FLASH_CASES, dtype_id, random_doc_ids, randn

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter's bf16 arithmetic is wrong, so bf16 is tested on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def triton_kernels():
    """These tests are of the Triton kernels: on a Hopper GPU too (tests/attention/flash/test_hopper.py has the others)."""
    with use_kernels("triton"):
        yield


def run_flash(q, k, v, causal, scale):
    return FlashAttention.apply(q, k, v, causal, scale)


# In the interpreter a case of more than 2500 scores a head takes a second or more: those run with -m slow.
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.n_q * c.n_k > 2500 else [])
                                  for c in FLASH_CASES])
def test_matches_float64_reference(case, dtype, check_flash):
    check_flash(run_flash, case, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)]
                         + ([torch.bfloat16] if CUDA else []), ids=dtype_id)
def test_backward_is_bitwise_deterministic(dtype):
    q, k, v = (randn(1, 2, 100, 48, dtype=dtype, seed=s).requires_grad_() for s in range(3))
    o = FlashAttention.apply(q, k, v, True)
    do = randn(*o.shape, dtype=dtype, seed=3)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two backward passes"
    assert torch.equal(o, FlashAttention.apply(q, k, v, True)), "forward differs between two runs"


@pytest.mark.parametrize("causal, n_q, n_k", [(True, 100, 100), (False, 100, 37)], ids=["causal", "q100-k37"])
def test_every_output_element_is_written(check_every_element_written, causal, n_q, n_k):
    check_every_element_written(FlashAttention, causal, n_q, n_k)


def test_outputs_follow_the_memory_order_of_their_inputs():
    """(b, h, s, d) views of (b, s, h, d) storage get o and grads in that order (every element written); 5-d inputs
    get contiguous ones, which the kernels can address as (b * h, s, d)."""
    q, k, v = (randn(2, 40, 3, 32, seed=s).transpose(1, 2).requires_grad_() for s in range(3))
    with nan_filled_outputs():
        assert empty((2,), torch.float32, DEVICE).isnan().all(), "outputs must start as NaN"
        o = FlashAttention.apply(q, k, v, True)
        grads = torch.autograd.grad(o, (q, k, v), randn(*o.shape, seed=3))
    for name, t, like in zip(("o", "dq", "dk", "dv"), (o, *grads), (q, q, k, v)):
        assert t.stride() == like.stride(), f"{name} has strides {t.stride()}, its input {like.stride()}"
        assert not t.isnan().any(), f"{name} has elements the kernels never wrote"
    assert o.transpose(1, 2).is_contiguous()  # so "b h s d -> b s (h d)" is a view
    q5, k5, v5 = (randn(2, 2, 2, 24, 16, seed=s).requires_grad_() for s in range(3))
    o5 = FlashAttention.apply(q5, k5, v5, False)
    assert o5.is_contiguous() and all(g.is_contiguous() for g in torch.autograd.grad(o5.sum(), (q5, k5, v5)))


# Padded keys overflow exp2 in rows that are computed but never stored; the CPU interpreter (numpy) warns.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_very_negative_scores_with_a_ragged_key_tile(dtype, flash_reference, rel_error, tolerance):
    """Every score near -200: L is very negative, so exp(-L) for a padded key would overflow if not masked."""
    d, n_q, n_k = 16, 40, 37
    u = 7 * randn(d, seed=0)  # q ~ -u and k ~ u, so q . k ~ -|u|^2
    q = (-u + randn(1, 2, n_q, d, seed=1)).to(dtype).requires_grad_()
    k = (u + randn(1, 2, n_k, d, seed=2)).to(dtype).requires_grad_()
    v = randn(1, 2, n_k, d, dtype=dtype, seed=3).requires_grad_()
    o = FlashAttention.apply(q, k, v, False)
    do = randn(*o.shape, dtype=dtype, seed=4)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    _, lse, *_ = ref = flash_reference(q, k, v, False, 1 / math.sqrt(d), do)
    assert lse.max() < -100, "the scores must be very negative for this test to mean anything"
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, (ref[0], *ref[2:])):
        # k = u + noise with |u| ~ 28 and each row of dS summing to 0: dq = dS @ k cancels the u part, and
        # rounding dS to bf16 (as FlashAttention-2 does, for the tensor cores) leaves ~|u| * 2^-8 of it, so
        # bf16 dq carries ~5% error against float64 here. The point of this test is finiteness and masking.
        limit = 0.1 if (dtype == torch.bfloat16 and name == "dq") else tolerance[dtype]
        assert rel_error(a, b) <= limit, name


def test_saved_tensors_are_linear_in_seq(check_saved_tensors_are_linear_in_seq):
    check_saved_tensors_are_linear_in_seq(FlashAttention)


@pytest.mark.parametrize("dtype, d, expected", [
    (torch.float32, 64, "tf32x3"), (torch.float32, 128, "tf32x3"), (torch.float32, 256, "ieee"),
    (torch.float16, 64, "tf32"), (torch.bfloat16, 256, "tf32"),
])
def test_fp32_products_are_3xtf32_up_to_d128(dtype, d, expected):
    assert flash_triton._meta(torch.empty(1, 1, 8, d, dtype=dtype), causal=True)["DOT_PRECISION"] == expected


def test_tile_configs_keep_the_causal_band_whole_tiles():
    """fwd and dq step keys inside a query tile (BLOCK_M % BLOCK_N == 0); dkdv the reverse."""
    tables = [flash_triton.SEARCH_SPACES, flash_triton.DEFAULT_TILES,
              {k: [t] for k, t in flash_triton.INTERPRET_TILES.items()}]
    for table in tables:
        for kernel, tiles in table.items():
            for t in tiles:
                big, small = (t.block_n, t.block_m) if kernel == "dkdv" else (t.block_m, t.block_n)
                assert big % small == 0 and small >= 16, f"{kernel} {t}"


def test_autotuner_is_built_once_per_kernel():
    """A new Autotuner per launch would re-read its disk cache every call (host time on each attention call)."""
    pytest.importorskip("triton")
    for kernel in ("fwd", "dkdv", "dq"):
        assert flash_triton._autotuned(kernel) is flash_triton._autotuned(kernel)
    assert flash_triton._autotuned("fwd") is not flash_triton._autotuned("dq")


def test_tuned_config_is_launched_directly_after_the_first_call(monkeypatch):
    """The autotuner runs once per kernel and key; later calls launch its choice without it (host time)."""
    triton = pytest.importorskip("triton")
    if CUDA:
        pytest.skip("drives the autotune path with a stand-in tuner on the CPU interpreter")
    tuned_calls = []

    class StandIn:  # picks the interpreter's tiles, as a real tuner would pick its best config
        def __init__(self, kernel):
            self.kernel = kernel
            t = flash_triton.INTERPRET_TILES[kernel]
            self.best_config = triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n},
                                             num_warps=t.num_warps, num_stages=t.num_stages)

        def __getitem__(self, grid):
            def run(*args, **meta):
                tuned_calls.append(self.kernel)
                t = flash_triton._tiles_of(self.best_config)
                jit_fn = getattr(flash_triton._kernels(), flash_triton._KERNEL_NAMES[self.kernel])
                jit_fn[grid({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n})](
                    *args, **meta, **self.best_config.all_kwargs())
            return run

    tuners = {k: StandIn(k) for k in ("fwd", "dkdv", "dq")}
    monkeypatch.setattr(flash_triton, "_autotuned", tuners.__getitem__)
    monkeypatch.setattr(flash_triton, "interpreting", lambda: False)
    monkeypatch.setattr(flash_triton, "_autotune_enabled", lambda: True)
    monkeypatch.setattr(flash_triton, "_tuned", {})
    q, k, v, do = (randn(1, 2, 40, 16, seed=s) for s in range(4))
    results = []
    for _ in range(2):  # the kernels directly: the input checks would refuse the patched non-interpreter mode
        o, lse = flash_triton.forward(q, k, v, True, 0.25)
        results.append([o, *flash_triton.backward(q, k, v, o, lse, do, True, 0.25)])
    assert tuned_calls == ["fwd", "dq", "dkdv"]  # the second call went around the tuners
    assert all(torch.equal(a, b) for a, b in zip(*results))
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=0.25)
    assert torch.allclose(results[1][0].double(), expected, atol=1e-4)
    q2 = randn(1, 2, 48, 16, seed=5)  # a new key tunes again
    flash_triton.forward(q2, q2, q2, True, 0.25)
    assert tuned_calls[-1] == "fwd" and len(tuned_calls) == 4


def test_autotune_pruning_respects_shared_memory_and_seq(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(flash_triton, "_smem_limit", lambda device_index: 227 * 1024)
    configs = [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps, num_stages=t.num_stages)
        for t in flash_triton.FWD_SEARCH_SPACE
    ]
    q = torch.empty(1, 1, 1, 256, dtype=torch.float32)
    kept = flash_triton._prune("fwd")(configs, {"Q": q, "N_Q": 17, "N_K": 17}, BLOCK_D=256)
    assert 0 < len(kept) < len(configs)
    for c in kept:
        t = Tiles(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        assert flash_triton._smem_bytes("fwd", t, 256, 4) <= 227 * 1024 and t.block_m <= 64
    # Nothing fits a tiny limit: the smallest config is kept rather than none.
    monkeypatch.setattr(flash_triton, "_smem_limit", lambda device_index: 1)
    assert len(flash_triton._prune("fwd")(configs, {"Q": q, "N_Q": 4096, "N_K": 4096}, BLOCK_D=256)) == 1


# ----------------------------------------------------------------------------------------------------------
# GPU only: long sequences, tensors beyond 2^31 elements, every tile shape of the autotune space.
# ----------------------------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("d", [64, 128])
def test_long_causal_matches_sdpa_fp32(d, dtype):
    q, k, v = (randn(1, 8, 4096, d, dtype=dtype, seed=s).requires_grad_() for s in range(3))
    o = FlashAttention.apply(q, k, v, True)
    do = randn(*o.shape, dtype=dtype, seed=3)
    grads = torch.autograd.grad(o, (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    grads32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    errors = {n: _rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o32, *grads32))}
    assert all(e <= 2e-2 for e in errors.values()), errors


@requires_cuda
@pytest.mark.parametrize("kernels", ["triton", "auto"])  # auto: the Hopper kernels on an sm_90 GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=dtype_id)
def test_beyond_2_31_elements(monkeypatch, dtype, kernels):
    """int64 offsets: q, o, dq, dk, dv have head bases past 2^31; k, v (transposed views) have row offsets past it."""
    b, h, n, d = 1, 520, 32768, 128  # 2.18e9 elements per tensor, 4.4 GB in bf16
    numel = b * h * n * d
    assert numel > 2**31
    if torch.cuda.mem_get_info()[0] < 9 * numel * 2:
        pytest.skip("needs about 40 GB of free GPU memory")
    monkeypatch.setattr(flash_triton, "_autotune_enabled", lambda: False)  # one run per kernel, no tuning
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, n, h, d, generator=gen, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
    do = torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    with use_kernels(kernels):
        o, lse = flash_forward(q, k, v, False, scale)
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, False, scale)
    last = (slice(None), slice(h - 1, h))  # the last head: the largest offsets
    q32, k32, v32 = (t[last].float().requires_grad_() for t in (q, k, v))
    o32 = F.scaled_dot_product_attention(q32, k32, v32)
    grads32 = torch.autograd.grad(o32, (q32, k32, v32), do[last].float())
    lse32 = torch.logsumexp((q32[..., -256:, :] @ k32.transpose(-2, -1)) * scale, dim=-1)
    errors = {
        "o": _rel(o[last], o32), "L": _rel(lse[last][..., -256:], lse32),
        "dq": _rel(dq[last], grads32[0]), "dk": _rel(dk[last], grads32[1]), "dv": _rel(dv[last], grads32[2]),
    }
    assert all(e <= 2e-2 for e in errors.values()), errors


def _sweep(kernel: str) -> list[Tiles]:
    """Every (BLOCK_M, BLOCK_N, num_warps) of the kernel's search space, at num_stages=2."""
    shapes = sorted({(t.block_m, t.block_n, t.num_warps) for t in flash_triton.SEARCH_SPACES[kernel]})
    return [Tiles(m, n, w, 2) for m, n, w in shapes]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16], ids=dtype_id)
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_tile_shape_of_the_search_space_is_correct(flash_reference, kernel, causal, dtype):
    n_q, n_k, d = (300, 300, 80) if causal else (300, 190, 80)  # ragged in both, padded head dim
    q = randn(1, 2, n_q, d, dtype=dtype, seed=0)
    k, v = (randn(1, 2, n_k, d, dtype=dtype, seed=s) for s in (1, 2))
    do = randn(1, 2, n_q, d, dtype=dtype, seed=3)
    scale = 1.0 / math.sqrt(d)
    ref = dict(zip(("o", "L", "dq", "dk", "dv"), flash_reference(q, k, v, causal, scale, do)))
    o, lse = flash_forward(q, k, v, causal, scale)
    failures = []
    for tiles in _sweep(kernel):
        if kernel == "fwd":
            got = dict(zip(("o", "L"), flash_forward(q, k, v, causal, scale, tiles=tiles)))
        else:
            grads = flash_backward(q, k, v, o, lse, do, causal, scale, tiles={kernel: tiles})
            got = dict(zip(("dq", "dk", "dv"), grads))
            got = {"dq": got["dq"]} if kernel == "dq" else {"dk": got["dk"], "dv": got["dv"]}
        errors = {name: _rel(t.cpu().double(), ref[name]) for name, t in got.items()}
        if not all(e <= 1e-2 for e in errors.values()):
            failures.append((tiles, errors))
    assert not failures, failures


@requires_cuda
def test_a_launch_seen_before_runs_its_compiled_kernel(monkeypatch):
    """The second launch of a kind calls the compiled kernel directly, with the same result; a pointer that is not
    16-byte aligned is another specialisation of the kernel, so another entry."""
    q, k, v, do = (randn(1, 2, 128, 64, dtype=torch.float16, seed=s) for s in range(4))
    o, lse = flash_triton.forward(q, k, v, True, 0.125)
    flash_triton.backward(q, k, v, o, lse, do, True, 0.125)  # autotunes, where that is on
    monkeypatch.setattr(flash_triton, "_compiled", {})
    o, lse = flash_triton.forward(q, k, v, True, 0.125)
    first = flash_triton.backward(q, k, v, o, lse, do, True, 0.125)
    seen = len(flash_triton._compiled)
    assert seen == 3  # forward, dQ (which writes delta), dK/dV
    o2, lse2 = flash_triton.forward(q, k, v, True, 0.125)
    again = flash_triton.backward(q, k, v, o2, lse2, do, True, 0.125)
    assert len(flash_triton._compiled) == seen
    assert torch.equal(o, o2) and all(torch.equal(a, b) for a, b in zip(first, again))
    offset = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view_as(q).copy_(q)  # 2 bytes off
    o3, _ = flash_triton.forward(offset, k, v, True, 0.125)
    assert len(flash_triton._compiled) == seen + 1
    torch.testing.assert_close(o3, o, atol=2e-3, rtol=0)


@pytest.mark.parametrize("h, h_kv, n", [pytest.param(2, 2, 100, marks=pytest.mark.slow), (4, 2, 40)])
def test_the_dq_kernel_writes_the_delta_that_dkdv_reads(monkeypatch, h, h_kv, n):
    """The backward is two launches: dQ, which computes delta = rowsum(dO * O) for its rows and writes it, then
    dK/dV, which reads it (no pre-pass kernel)."""
    launched = []
    real = flash_triton._launch

    def spy(kernel, seq_lens, bh, args, n_tensors, *rest, **kwargs):
        launched.append((kernel, args[6] if kernel == "dq" else args[5]))  # the delta each kernel is given
        return real(kernel, seq_lens, bh, args, n_tensors, *rest, **kwargs)

    q = randn(2, h, n, 16, seed=0)
    k, v = (randn(2, h_kv, n, 16, seed=s) for s in (1, 2))
    o, lse = flash_triton.forward(q, k, v, True, 0.25)
    do = randn(*o.shape, seed=3)
    monkeypatch.setattr(flash_triton, "_launch", spy)
    monkeypatch.setattr(flash_triton, "delta_and_launch", None)  # the Hopper backward's pre-pass: not called
    flash_triton.backward(q, k, v, o, lse, do, True, 0.25)
    assert [kernel for kernel, _ in launched] == ["dq", "dkdv"]
    (_, written), (_, read) = launched
    assert written is read
    torch.testing.assert_close(written.double(), (do.double() * o.double()).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("h, n, d", [(3, 100, 64), (2, 128, 128)], ids=str)
def test_the_hopper_pre_pass_writes_delta_and_zeroes_the_fused_accumulator(layout, h, n, d):
    """delta_and_launch: delta = rowsum(dO * O) in fp32, and with the fused backward's accumulator, every element of
    it zeroed by the same launch; its launch repeats both on new tensors."""
    from attention.flash.hopper.host import accumulator_shape

    def inputs(seed):
        shape = (2, n, h, d) if layout == "bshd" else (2, h, n, d)
        o, do = (randn(*shape, seed=seed + i) for i in range(2))
        if layout == "bshd":
            o, do = o.transpose(1, 2), do.transpose(1, 2)
        return o, do, torch.full(accumulator_shape(o), float("nan"), device=o.device)

    o, do, acc = inputs(0)
    delta, launch = flash_triton.delta_and_launch(o, do, acc)
    want = (o.double() * do.double()).sum(-1)
    torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(acc, torch.zeros_like(acc))
    o, do, acc = inputs(5)
    launch(o, do, delta, acc)
    torch.testing.assert_close(delta.double(), (o.double() * do.double()).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(acc, torch.zeros_like(acc))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_dq_from_accumulator_scales_into_dq(layout, dtype):
    """The fused backward's last launch: dq = scale * the (batch * heads, seq, d) accumulator, in dq's dtype and
    memory order, every element written."""
    b, h, n, d = 2, 3, 100, 64
    acc = randn(b * h, n, d, seed=1)
    dq = (torch.full((b, n, h, d), float("nan"), dtype=dtype, device=acc.device).transpose(1, 2) if layout == "bshd"
          else torch.full((b, h, n, d), float("nan"), dtype=dtype, device=acc.device))
    flash_triton.dq_from_accumulator(acc, dq, 0.125)
    want = (0.125 * acc.double()).view(b, h, n, d)
    torch.testing.assert_close(dq.double(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("b, n, rows, tile, causal, window", [
    (1, 1024, 128, 64, True, None), (3, 640, 128, 64, True, 200), (2, 700, 64, 32, False, None),
    (2, 512, 192, 64, False, 100)], ids=["causal", "causal-window", "documents", "window"])
def test_work_order_ranks_items_by_the_key_tiles_they_stream(b, n, rows, tile, causal, window):
    """work_order lists each (sequence, block of `rows` queries) once, by the key tiles the block streams (counted
    here from the documents' bounds position by position), most first, ties in index order."""
    from attention.masks import doc_bounds

    doc_ids = random_doc_ids(b, n, 1, 300, seed=n)
    starts, ends = doc_bounds(doc_ids, (b,), n)
    order, _ = flash_triton.work_order(starts, ends, n, rows, tile, causal, window)
    blocks = math.ceil(n / rows)
    costs = []
    for seq in range(b):
        for block in range(blocks):
            first, last = block * rows, min(block * rows + rows, n) - 1
            seen = set()
            for i in range(first, last + 1):  # the keys query i sees
                lo, hi = int(starts[seq, i]), int(ends[seq, i])
                if causal:
                    hi = min(hi, i + 1)
                if window is not None:
                    lo = max(lo, i - window + 1)
                    if not causal:
                        hi = min(hi, i + window)
                seen.update(range(lo, hi))
            costs.append(max(seen) // tile - min(seen) // tile + 1)
    want = sorted(range(len(costs)), key=lambda item: (-costs[item], item))
    assert order.dtype == torch.int32 and order.tolist() == want
