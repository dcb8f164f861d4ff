"""The registered `flash` backend (attention/flash/api.py): what it refuses and why, before any kernel loads, and its
one route to the kernels. Under torch.compile it runs as a pair of torch.library operators: triton_ops on the GPU,
whose kernels Inductor launches itself, opaque custom ops in the CPU interpreter. They give bitwise what the eager
autograd.Function gives and compile without a graph break (fullgraph), inside a compiled model too."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention import UnsupportedInputError, get_attention, list_attention, why_not
from attention.flash import dispatch, flash_backward, flash_forward
from attention.flash.api import FlashAttention, flash_op
from attention.flash.hopper import host as hopper
from attention.flash.triton import host as flash_triton
from model import ModelConfig, TransformerLM
from tests.attention.conftest import randn
from training.compilation import compile_regions

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 arithmetic is wrong
REPO_ROOT = Path(__file__).resolve().parents[3]


def test_registry_lists_and_runs_flash():
    rows = {r.name: r for r in list_attention()}
    names = list(rows)
    assert names.index("flash") < names.index("flash-torch")
    assert rows["flash"].available, rows["flash"].reason
    q, k, v = (randn(2, 1, 40, 32, seed=s) for s in range(3))
    out = get_attention("flash")(q, k, v, causal=True)
    assert torch.equal(out, flash_forward(q, k, v, True, 1 / math.sqrt(32))[0])
    assert torch.equal(out, FlashAttention.apply(q, k, v, True))  # the Function eager calls run, scale by default
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

    for module, name in ((flash_triton, "_kernels"), (flash_triton, "_launch"), (dispatch, "forward"),
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
        get_attention("flash")(q, k, v, causal=causal, scale=scale)
    if scale is None:  # why_not reports it without raising
        assert why_not("flash", q, k, v, causal) is not None


def test_cpu_tensors_without_interpreter_are_refused(no_launch, monkeypatch):
    monkeypatch.setattr(flash_triton, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the environment check
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(UnsupportedInputError, match="CPU tensors need TRITON_INTERPRET=1"):
        get_attention("flash")(q, q, q, causal=False)
    assert "CPU tensors need TRITON_INTERPRET=1" in why_not("flash", q, q, q, False)


def run_python(code: str, drop_env: tuple[str, ...] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow  # a fresh Python importing torch
def test_import_without_triton_reports_why():
    out = run_python(
        "import sys; sys.modules['triton'] = None  # any `import triton` now raises ImportError\n"
        "import torch\n"
        "from attention import UnsupportedInputError, get_attention, list_attention\n"
        "from attention.flash import FlashAttentionTriton\n"
        "rows = {r.name: r for r in list_attention()}\n"
        "assert rows['flash-torch'].available\n"
        "print('REASON', rows['flash'].available, rows['flash'].reason)\n"
        "q = torch.randn(1, 1, 8, 16)\n"
        "try:\n"
        "    get_attention('flash')(q, q, q, causal=True)\n"
        "except UnsupportedInputError as e:\n"
        "    print('ERROR', e)\n"
    )
    assert "REASON False triton is not installed" in out
    assert "ERROR attention backend 'flash' cannot run this input: triton is not installed" in out


@pytest.mark.slow  # a fresh Python importing torch
@pytest.mark.skipif(CUDA, reason="checks the message on a machine without a GPU")
def test_import_without_gpu_or_interpreter_reports_why():
    out = run_python(
        "from attention import list_attention\n"
        "rows = {r.name: r for r in list_attention()}\n"
        "print('REASON', rows['flash'].available, rows['flash'].reason)\n",
        drop_env=("TRITON_INTERPRET",),
    )
    assert "REASON False needs a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors" in out



# ----------------------------------------------------------------------------------------------------------
# Compiled calls: the operators
# ----------------------------------------------------------------------------------------------------------


def qkv(shape=(2, 3, 40, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(DEVICE, DTYPE).requires_grad_() for _ in range(3)]


def grads_of(fn, inputs, seed=1):
    out = fn(*inputs)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return (out, *torch.autograd.grad(out, inputs, do))


@pytest.mark.parametrize("route", ["operator", pytest.param("traced-launches", marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["causal", "full"])
def test_operators_equal_the_autograd_function_bitwise(route, causal):
    """flash_op, and the launches its triton_op body makes (traceable: torch.library.wrap_triton, which the CPU
    interpreter runs unwrapped), give bitwise what the eager Function gives."""
    inputs = qkv()
    scale = 32**-0.5
    ref = grads_of(lambda q, k, v: FlashAttention.apply(q, k, v, causal), inputs)
    if route == "operator":
        ours = grads_of(lambda q, k, v: flash_op(q, k, v, causal, scale, False, "auto")[0], inputs)
    else:
        q, k, v = (t.detach() for t in inputs)
        o, lse = flash_forward(q, k, v, causal, scale, traceable=True)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o)
        ours = (o, *flash_backward(q, k, v, o, lse, do, causal, scale, traceable=True))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.slow  # torch.compile
def test_compiles_in_one_graph_and_matches_eager():
    torch._dynamo.reset()
    flash = get_attention("flash")

    def attend(q, k, v):  # with work around it, so the compiled graph has more than the op
        return flash(q * 0.5, k, v, causal=True).sin()

    inputs = qkv(seed=2)
    eager = grads_of(attend, inputs)
    compiled = grads_of(torch.compile(attend, fullgraph=True), inputs)  # fullgraph: a graph break would raise
    # Inductor fuses q * 0.5 and sin() in fp32 where eager rounds each result to the input dtype.
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.skipif(not CUDA, reason="Inductor launches the Triton kernels itself on the GPU only")
def test_inductor_launches_the_kernels_itself(monkeypatch):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    monkeypatch.setattr(flash_triton, "_kernel_module", None)  # first use under compile loads the kernels
    flash = get_attention("flash")
    inputs = qkv(seed=3)

    compiled = torch.compile(lambda q, k, v: flash(q, k, v, causal=True), fullgraph=True)

    def step():  # the backward graph is compiled at the first backward
        compiled(*inputs).float().square().sum().backward()

    _, code = run_and_get_code(step)
    code = "\n".join(code)
    for kernel in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
        assert kernel in code
    assert "attn_bwd_delta" not in code  # the dQ kernel computes delta
    assert "flash_lm" not in code  # no call back into an operator: the generated code launches the kernels


@pytest.mark.slow  # torch.compile
def test_model_with_flash_trains_under_regional_compile():
    torch._dynamo.reset()
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, vocab_size=97, context_length=48)
    torch.manual_seed(0)
    with DEVICE:
        eager = TransformerLM(cfg, "flash")
        compiled = TransformerLM(cfg, "flash")
    compiled.load_state_dict(eager.state_dict())
    compile_regions(compiled)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), device=DEVICE)
    losses = []
    for m in (eager, compiled):
        loss = m(ids, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def _record_replayed(monkeypatch) -> list[tuple[str, bool]]:
    """Make the Hopper kernels' dispatch questions record (pass, replayed); the answers stay what they were."""
    from attention.flash.hopper import inputs as hopper_inputs

    asked: list[tuple[str, bool]] = []
    forward, backward = hopper_inputs.forward_problem, hopper_inputs.backward_problem

    def forward_problem(q, k, v, causal, replayed=False, *rest):
        asked.append(("forward", replayed))
        return forward(q, k, v, causal, replayed, *rest)

    def backward_problem(q, k, v, do, causal, replayed=False, *rest):
        asked.append(("backward", replayed))
        return backward(q, k, v, do, causal, replayed, *rest)

    monkeypatch.setattr(hopper_inputs, "forward_problem", forward_problem)
    monkeypatch.setattr(hopper_inputs, "backward_problem", backward_problem)
    return asked


@pytest.mark.slow  # flash in the interpreter, four times
def test_eager_flash_asks_the_dispatch_whether_launches_are_replayed(monkeypatch):
    from attention import graph_replay

    asked = _record_replayed(monkeypatch)
    flash = get_attention("flash")
    inputs = qkv(seed=4)
    grads_of(lambda q, k, v: flash(q, k, v, causal=True), inputs)
    with graph_replay():
        grads_of(lambda q, k, v: flash(q, k, v, causal=True), inputs)
    # The backward runs on autograd's own thread and still sees the block the forward ran in.
    assert asked == [("forward", False), ("backward", False), ("forward", True), ("backward", True)]


@pytest.mark.slow  # torch.compile
def test_compiled_flash_keeps_the_replay_choice_it_was_traced_with(monkeypatch, request):
    from attention import graph_replay

    torch._dynamo.reset()
    # No cached graphs: a compiled graph of the same shapes from an earlier test would skip tracing the backward.
    for config, flag in ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache")):
        patch = config.patch({flag: False})
        patch.__enter__()
        request.addfinalizer(lambda patch=patch: patch.__exit__(None, None, None))
    asked = _record_replayed(monkeypatch)
    flash = get_attention("flash")
    compiled = torch.compile(lambda q, k, v: flash(q, k, v, causal=True), fullgraph=True)
    inputs = qkv(seed=5)
    with graph_replay():
        grads_of(compiled, inputs)
    traced_inside = list(asked)
    assert traced_inside and all(replayed for _, replayed in traced_inside)
    assert {p for p, _ in traced_inside} == {"forward", "backward"}
    asked.clear()
    grads_of(compiled, inputs)  # outside the block: the guard on it fails, so this traces again
    assert asked and not any(replayed for _, replayed in asked)
