"""Under torch.compile the registry's "flash" runs as a pair of torch.library operators: triton_ops on the GPU, whose
kernels Inductor launches itself, opaque custom ops in the CPU interpreter. Both give the same results as
FlashAttentionTriton.apply (what eager calls) and compile without a graph break (fullgraph), inside a compiled model
too."""

from __future__ import annotations

import pytest
import torch

from attention import get_attention
from attention.flash import FlashAttentionTriton, flash_op, flash_opaque_op
from model import ModelConfig, TransformerLM
from training.compilation import compile_regions

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 arithmetic is wrong


def qkv(shape=(2, 3, 40, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(DEVICE, DTYPE).requires_grad_() for _ in range(3)]


def grads_of(fn, inputs, seed=1):
    out = fn(*inputs)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return (out, *torch.autograd.grad(out, inputs, do))


@pytest.mark.parametrize("op", [flash_op, flash_opaque_op], ids=["triton_op", "custom_op"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_operators_equal_the_autograd_function_bitwise(op, causal):
    inputs = qkv()
    ours = grads_of(lambda q, k, v: op(q, k, v, causal, 32**-0.5, False, "auto")[0], inputs)
    ref = grads_of(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, causal), inputs)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


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

    from attention.flash.triton import host as flash_triton

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


def test_model_with_flash_trains_under_regional_compile():
    torch._dynamo.reset()
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, vocab_size=97, context_length=48, attn="flash")
    torch.manual_seed(0)
    with DEVICE:
        eager = TransformerLM(cfg)
        compiled = TransformerLM(cfg)
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


@pytest.mark.parametrize("dtype, d, expected", [
    (torch.float32, 64, "tf32x3"), (torch.float32, 128, "tf32x3"), (torch.float32, 256, "ieee"),
    (torch.float16, 64, "tf32"), (torch.bfloat16, 256, "tf32"),
])
def test_fp32_products_are_3xtf32_up_to_d128(dtype, d, expected):
    from attention.flash.triton.host import _meta

    assert _meta(torch.empty(1, 1, 8, d, dtype=dtype), causal=True)["DOT_PRECISION"] == expected


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
