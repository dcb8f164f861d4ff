"""`flash` through its Triton kernels (attention/flash/triton.py) against a float64 reference; without a GPU they run
in the Triton interpreter (conftest.py switches it on). `flash_case` is parametrized by conftest.FLASH_CASES."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attention import UnsupportedInputError, get_attention, list_attention, why_not
from attention.flash import FlashAttentionTriton, Tiles, flash_backward, flash_forward, use_kernels
from attention.flash.hopper import host as hopper
from attention.flash.triton import host as flash_triton
import attention.flash as flash_pkg
from attention.flash.common import empty, nan_filled_outputs
from tests.attention.conftest import dtype_id, random_doc_ids, randn

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter's bf16 arithmetic is wrong, so bf16 is tested on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
REPO_ROOT = Path(__file__).resolve().parents[3]
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def triton_kernels():
    """These tests are of the Triton kernels: on a Hopper GPU too (tests/attention/flash/test_hopper.py has the others)."""
    with use_kernels("triton"):
        yield


def run_flash(q, k, v, causal, scale):
    return FlashAttentionTriton.apply(q, k, v, causal, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_float64_reference(flash_case, dtype, check_flash):
    check_flash(run_flash, flash_case, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_backward_is_bitwise_deterministic(dtype):
    q, k, v = (randn(1, 2, 100, 48, dtype=dtype, seed=s).requires_grad_() for s in range(3))
    o = FlashAttentionTriton.apply(q, k, v, True)
    do = randn(*o.shape, dtype=dtype, seed=3)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two backward passes"
    assert torch.equal(o, FlashAttentionTriton.apply(q, k, v, True)), "forward differs between two runs"


@pytest.mark.parametrize("causal, n_q, n_k", [(True, 100, 100), (False, 100, 37)], ids=["causal", "q100-k37"])
def test_every_output_element_is_written(check_every_element_written, causal, n_q, n_k):
    check_every_element_written(FlashAttentionTriton, causal, n_q, n_k)


def test_outputs_follow_the_memory_order_of_their_inputs():
    """(b, h, s, d) views of (b, s, h, d) storage get o and grads in that order (every element written); 5-d inputs
    get contiguous ones, which the kernels can address as (b * h, s, d)."""
    q, k, v = (randn(2, 40, 3, 32, seed=s).transpose(1, 2).requires_grad_() for s in range(3))
    with nan_filled_outputs():
        assert empty((2,), torch.float32, DEVICE).isnan().all(), "outputs must start as NaN"
        o = FlashAttentionTriton.apply(q, k, v, True)
        grads = torch.autograd.grad(o, (q, k, v), randn(*o.shape, seed=3))
    for name, t, like in zip(("o", "dq", "dk", "dv"), (o, *grads), (q, q, k, v)):
        assert t.stride() == like.stride(), f"{name} has strides {t.stride()}, its input {like.stride()}"
        assert not t.isnan().any(), f"{name} has elements the kernels never wrote"
    assert o.transpose(1, 2).is_contiguous()  # so "b h s d -> b s (h d)" is a view
    q5, k5, v5 = (randn(2, 2, 2, 24, 16, seed=s).requires_grad_() for s in range(3))
    o5 = FlashAttentionTriton.apply(q5, k5, v5, False)
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
    o = FlashAttentionTriton.apply(q, k, v, False)
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
    check_saved_tensors_are_linear_in_seq(FlashAttentionTriton)


def test_registry_lists_and_runs_flash():
    rows = {r.name: r for r in list_attention()}
    names = list(rows)
    assert names.index("flash") < names.index("flash-torch")
    assert rows["flash"].available, rows["flash"].reason
    q, k, v = (randn(2, 1, 40, 32, seed=s) for s in range(3))
    out = get_attention("flash")(q, k, v, causal=True)
    assert torch.equal(out, FlashAttentionTriton.apply(q, k, v, True))
    assert why_not("flash", q, k, v, True) is None


BAD_INPUTS = [
    # id, q shape, k shape, v shape, dtypes (q, k, v), causal, scale, message
    ("k-v-shapes", (1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 9, 16), None, False, None, "k and v must have the same shape"),
    ("dtypes", (1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), (torch.float32, torch.float16, torch.float32), False,
     None, "must share a dtype"),
    ("head-dim-8", (1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8), None, False, None,
     r"head dim 8 is not supported: flash needs 16 <= d_head <= 256"),
    ("head-dim-320", (1, 1, 8, 320), (1, 1, 8, 320), (1, 1, 8, 320), None, False, None, r"head dim 320 is not supp"),
    ("float64", (1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), (torch.float64,) * 3, False, None,
     r"dtype torch\.float64 is not supported"),
    ("causal-lengths", (1, 1, 8, 16), (1, 1, 9, 16), (1, 1, 9, 16), None, True, None,
     "causal attention needs equal query and key lengths"),
    ("scale-negative", (1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), None, False, -1.0, "finite positive scale"),
    ("scale-nan", (1, 1, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), None, False, float("nan"), "finite positive scale"),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Bad input must be refused before any kernel is loaded or launched."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was loaded or launched for bad input")

    for module, name in ((flash_triton, "_kernels"), (flash_triton, "_launch"), (flash_triton, "forward"),
                         (hopper, "run_forward")):
        monkeypatch.setattr(module, name, launched)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, dtypes, causal, scale, message",
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_refused_with_its_reason(no_launch, q_shape, k_shape, v_shape, dtypes, causal, scale, message):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (randn(*s, dtype=dt, seed=i) for i, (s, dt) in enumerate(zip((q_shape, k_shape, v_shape), dtypes)))
    with pytest.raises(UnsupportedInputError, match=message):
        FlashAttentionTriton.apply(q, k, v, causal, scale)
    if scale is None:  # the registry path gives the same reason, and why_not reports it without raising
        with pytest.raises(UnsupportedInputError, match=message):
            get_attention("flash")(q, k, v, causal=causal)
        assert why_not("flash", q, k, v, causal) is not None


def test_cpu_tensors_without_interpreter_are_refused(no_launch, monkeypatch):
    monkeypatch.setattr(flash_triton, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the environment check
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(UnsupportedInputError, match="CPU tensors need TRITON_INTERPRET=1"):
        FlashAttentionTriton.apply(q, q, q, False)
    assert "CPU tensors need TRITON_INTERPRET=1" in why_not("flash", q, q, q, False)


def run_python(code: str, drop_env: tuple[str, ...] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_without_triton_reports_why():
    out = run_python(
        "import sys; sys.modules['triton'] = None  # any `import triton` now raises ImportError\n"
        "import torch\n"
        "from attention import UnsupportedInputError, list_attention\n"
        "from attention.flash import FlashAttentionTriton\n"
        "rows = {r.name: r for r in list_attention()}\n"
        "assert rows['flash-torch'].available\n"
        "print('REASON', rows['flash'].available, rows['flash'].reason)\n"
        "q = torch.randn(1, 1, 8, 16)\n"
        "try:\n"
        "    FlashAttentionTriton.apply(q, q, q, True)\n"
        "except UnsupportedInputError as e:\n"
        "    print('ERROR', e)\n"
    )
    assert "REASON False triton is not installed" in out
    assert "ERROR attention backend 'flash' cannot run this input: triton is not installed" in out


@pytest.mark.skipif(CUDA, reason="checks the message on a machine without a GPU")
def test_import_without_gpu_or_interpreter_reports_why():
    out = run_python(
        "from attention import list_attention\n"
        "rows = {r.name: r for r in list_attention()}\n"
        "print('REASON', rows['flash'].available, rows['flash'].reason)\n",
        drop_env=("TRITON_INTERPRET",),
    )
    assert "REASON False needs a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors" in out


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
# Eager plans: the second call of an input signature launches what the first resolved
# ----------------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_a_signature_seen_before_runs_its_plan_with_the_same_results(monkeypatch, case):
    """The first eager call resolves the launches; the second, on fresh inputs of that signature, runs them without
    the general path, and gives bitwise what the general path gives."""
    _, _, causal, variants, _ = PLAN_CASES[case]
    flash = get_attention("flash")
    first = _plan_inputs(case, seed=0)
    o = flash(*first, causal=causal, **variants)
    torch.autograd.grad(o, first, randn(*o.shape, seed=19))  # the plans are per gradient layout: this one's
    assert len(flash_pkg._plans) == 1 and len(next(iter(flash_pkg._plans.values()))[1]) == 1
    inputs = _plan_inputs(case, seed=10)
    do = randn(*o.shape, seed=20)
    expected = grads_of_flash(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, causal, None, *variants.values()),
                              inputs, do)

    def refused(*args, **kwargs):
        raise AssertionError("the general path ran for a signature that has a plan")

    for module, name in ((flash_triton, "_launch"), (flash_triton, "delta_and_launch"), (flash_pkg, "_check")):
        monkeypatch.setattr(module, name, refused)
    planned = grads_of_flash(lambda q, k, v: flash(q, k, v, causal=causal, **variants), inputs, do)
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))
    assert planned[0].stride() == expected[0].stride() and planned[1].stride() == inputs[0].stride()


def grads_of_flash(fn, inputs, do):
    o = fn(*inputs)
    return (o, *torch.autograd.grad(o, inputs, do))


def test_each_signature_gets_its_own_plan():
    flash = get_attention("flash")
    q, k, v = (randn(1, 2, 32, 16, seed=s) for s in range(3))
    flash(q, k, v, causal=True)
    flash(q + 1, k, v, causal=True)  # other values, same signature
    assert len(flash_pkg._plans) == 1
    other_signatures = [
        dict(q=q[..., :24, :], k=k[..., :24, :], v=v[..., :24, :]),  # shape
        dict(q=q.transpose(-1, -2).contiguous().transpose(-1, -2)),  # strides
        dict(q=q.half(), k=k.half(), v=v.half()),  # dtype
        dict(q=q.new_empty(q.numel() + 1)[1:].view_as(q).copy_(q)),  # 4 bytes off a 16-byte boundary
        dict(causal=False), dict(scale=0.3), dict(window=4), dict(softcap=2.0),
    ]
    for n, change in enumerate(other_signatures, start=2):
        args = {"q": q, "k": k, "v": v, "causal": True, **change}
        flash(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert len(flash_pkg._plans) == n, change
    with use_kernels("auto"):  # the kernel setting is part of the signature
        flash(q, k, v, causal=True)
    assert len(flash_pkg._plans) == len(other_signatures) + 2
    flash(q, k, v, causal=True, doc_ids=torch.tensor([0] * 16 + [1] * 16, device=q.device))  # documents
    flash(q, k, v, causal=True, doc_ids=torch.tensor([0] * 5 + [1] * 27, device=q.device))  # other ones, same plan
    assert len(flash_pkg._plans) == len(other_signatures) + 3
    flash(q.reshape(1, 1, 2, 32, 16), k.reshape(1, 1, 2, 32, 16), v.reshape(1, 1, 2, 32, 16), causal=True)  # 5 dims
    assert len(flash_pkg._plans) == len(other_signatures) + 3


@pytest.mark.parametrize("h, h_kv, window", [(2, 2, None), (4, 2, 6)])
def test_documents_run_through_the_plan_with_each_calls_bounds(monkeypatch, h, h_kv, window):
    """A signature with documents gets a plan like any other; each call's own documents reach its launches, forward
    and backward, bitwise as the general path computes them."""
    flash = get_attention("flash")
    b, n, d = 2, 40, 16

    def inputs(seed):
        return [randn(b, heads, n, d, seed=seed + i).requires_grad_() for i, heads in enumerate((h, h_kv, h_kv))]

    first = inputs(0)
    o = flash(*first, causal=True, window=window, doc_ids=random_doc_ids(b, n, 1, 12, seed=1))
    torch.autograd.grad(o, first, randn(*o.shape, seed=19))
    assert len(flash_pkg._plans) == 1
    q, k, v = inputs(10)
    doc_ids, do = random_doc_ids(b, n, 1, 12, seed=2), randn(*o.shape, seed=20)
    expected = grads_of_flash(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True, None, window, None, doc_ids),
                              (q, k, v), do)

    def refused(*args, **kwargs):
        raise AssertionError("the general path ran for a signature that has a plan")

    for module, name in ((flash_triton, "_launch"), (flash_triton, "delta_and_launch"), (flash_pkg, "_check")):
        monkeypatch.setattr(module, name, refused)
    planned = grads_of_flash(lambda q, k, v: flash(q, k, v, causal=True, window=window, doc_ids=doc_ids), (q, k, v),
                             do)
    assert all(torch.equal(a, b) for a, b in zip(planned, expected))
    assert len(flash_pkg._plans) == 1


def test_the_documents_bounds_are_computed_once_per_doc_ids_tensor(monkeypatch):
    """Calls that pass the same doc_ids tensor (a model's layers) compute its bounds once; a changed tensor (in place,
    or another one) or another sequence length gets its own, and the results stay those of fresh bounds."""
    import gc

    computed = []
    real = flash_pkg.bounds_of
    monkeypatch.setattr(flash_pkg, "bounds_of", lambda q, ids: computed.append(ids.tolist()) or real(q, ids))
    flash = get_attention("flash")
    q, k, v = (randn(2, 2, 24, 16, seed=s) for s in range(3))
    doc_ids = random_doc_ids(2, 24, 1, 8, seed=1)

    def check(ids):
        want = FlashAttentionTriton.apply(q, k, v, True, None, None, None, ids)
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
    assert len(computed) == 5 and flash_pkg._last_bounds is not None
    del doc_ids
    gc.collect()
    assert flash_pkg._last_bounds is None  # the bounds go with their doc_ids


@requires_cuda
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
    assert torch.equal(o, FlashAttentionTriton.apply(q, k, v, True, None, None, None, new_ids))


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
    o = FlashAttentionTriton.apply(q, k, v, True)
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


@pytest.mark.parametrize("h, h_kv, n", [(2, 2, 100), (4, 2, 40)])
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
