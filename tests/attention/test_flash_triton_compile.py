"""Under torch.compile the registry's "flash" runs as a pair of custom ops: the same results as
FlashAttentionTriton.apply (what eager calls), and one opaque kernel to the compiler (fullgraph: no graph
break), inside a compiled model too."""

from __future__ import annotations

import pytest
import torch

from attention import get_attention
from attention.flash_triton import FlashAttentionTriton, flash_op
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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_custom_op_equals_the_autograd_function_bitwise(causal):
    inputs = qkv()
    ours = grads_of(lambda q, k, v: flash_op(q, k, v, causal, 32**-0.5)[0], inputs)
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
    from attention.flash_triton import _meta

    assert _meta(torch.empty(1, 1, 8, d, dtype=dtype), causal=True)["DOT_PRECISION"] == expected
