"""model.fused_swiglu: silu(gate) * up out of the fused gate/up projection, its Triton kernels against a float64
reference; and SwiGLU's fused w1/w3 matmul (model.layers) against two."""

import functools
import os

import pytest
import torch

from model import fused_swiglu
from model.config import ModelConfig
from model.layers import SwiGLU
from model.transformer import TransformerLM
from training.step import keep_weight_copies

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or the Triton interpreter")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def reference(gate_up, grad):
    """float64 silu(gate) * up and the gradient of gate_up, (d gate, d up) side by side, for the output's `grad`."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    grad = grad.double()
    sig = torch.sigmoid(gate)
    out = gate * sig * up
    return out, torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], dim=-1)


# (leading dims, d_ff): one row, ragged rows, a d_ff past one block of columns and not a multiple of it.
SHAPES = [((1,), 8), ((3, 17), 40), ((2, 5), 1100)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * CUDA)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_match_float64(shape, dtype):
    lead, d_ff = shape
    gate_up = (3 * torch.randn(*lead, 2 * d_ff)).to(KERNEL_DEVICE, dtype)
    grad = torch.randn(*lead, d_ff).to(KERNEL_DEVICE, dtype)
    want_out, want_grad = reference(gate_up, grad)
    out = fused_swiglu.launch_silu_mul(gate_up)
    grad_gate_up = fused_swiglu.launch_silu_mul_backward(gate_up, grad)
    for name, got, want in (("out", out, want_out), ("grad", grad_gate_up, want_grad)):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(), name
        # fp32 math, one rounding to the output dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{name}: {m}")


@needs_kernels
def test_the_kernels_read_strided_rows_and_gradients():
    base = torch.randn(6, 2 * 24 + 5).to(KERNEL_DEVICE)
    gate_up = base[:, :48]  # rows 53 apart, the last dim contiguous
    grad = torch.randn(24, 6).to(KERNEL_DEVICE).t()  # not contiguous in the last dim
    want_out, want_grad = reference(gate_up, grad)
    torch.testing.assert_close(fused_swiglu.launch_silu_mul(gate_up).double(), want_out)
    torch.testing.assert_close(fused_swiglu.launch_silu_mul_backward(gate_up, grad).double(), want_grad)


def test_an_odd_width_is_refused():
    with pytest.raises(ValueError, match=r"silu_mul: gate_up needs an even last dim .* got \(2, 7\)"):
        fused_swiglu.silu_mul(torch.randn(2, 7))


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_the_cuda_op_and_its_gradient_match_pytorch_eager_and_compiled(compiled):
    gate_up = torch.randn(3, 33, 2 * 200, device="cuda", requires_grad=True)
    op = torch.compile(fused_swiglu.silu_mul, fullgraph=True) if compiled else fused_swiglu.silu_mul
    got, want = op(gate_up), fused_swiglu.silu_mul_reference(gate_up)
    grad = torch.randn_like(want)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(got, gate_up, grad)[0],
                               torch.autograd.grad(want, gate_up, grad)[0], rtol=1e-5, atol=1e-6)


def two_matmuls(m: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """The reference: SwiGLU with w1 and w3 as two matmuls (each Linear's own fp32-weight-gradient path)."""
    return m.w2(torch.nn.functional.silu(m.w1(x)) * m.w3(x))


def _swiglu_pair(d_model=32, d_ff=80):
    fused, apart = SwiGLU(d_model, d_ff), SwiGLU(d_model, d_ff)
    apart.load_state_dict(fused.state_dict())
    return fused, apart


@pytest.mark.parametrize("device", ["cpu"] + ["cuda"] * CUDA)
@pytest.mark.parametrize("copies", [False, True])
def test_fused_gate_up_gives_the_two_matmuls_results_and_gradients(device, copies):
    fused, apart = (m.to(device) for m in _swiglu_pair())
    if copies:  # the weight copies bf16 optimizer state keeps: w1's and w3's are halves of what the fused one reads
        copied = fused.keep_weight_copies(torch.bfloat16)
        assert set(copied) == {fused.w1.weight, fused.w2.weight, fused.w3.weight}
        assert fused.w1.weight_copy.data_ptr() == fused.gate_up_copy.data_ptr()
        assert fused.w3.weight_copy.data_ptr() == fused.gate_up_copy[80:].data_ptr()
    x = torch.randn(3, 7, 32, device=device)
    grad = torch.randn(3, 7, 32, device=device)
    results = []
    for m, forward in ((fused, fused), (apart, functools.partial(two_matmuls, apart))):
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = forward(xi)
        y.float().backward(grad)
        results.append((y, xi.grad, m.w1.weight.grad, m.w2.weight.grad, m.w3.weight.grad))
    for name, got, want in zip(("y", "dx", "dw1", "dw2", "dw3"), *results):
        assert got.dtype == want.dtype, name
        # bf16 matmuls and activations: the same products, rounded at other points (bf16 keeps 2^-9 relative)
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < 1e-2, f"{name}: relative error {error:.2e}"
    # One dW matmul for both: the two gradients are views of one tensor.
    assert fused.w1.weight.grad.untyped_storage().data_ptr() == fused.w3.weight.grad.untyped_storage().data_ptr()
    assert apart.w1.weight.grad.untyped_storage().data_ptr() != apart.w3.weight.grad.untyped_storage().data_ptr()


def test_without_autocast_the_layer_runs_the_two_matmuls():
    fused, apart = _swiglu_pair()
    x = torch.randn(4, 32)
    assert fused._gate_up(x) is None
    assert torch.equal(fused(x), two_matmuls(apart, x))


def test_keep_weight_copies_puts_w1_and_w3_in_one_tensor_and_loading_refreshes_it():
    model = TransformerLM(ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, vocab_size=11, context_length=8))
    copies = keep_weight_copies(model, "bf16")
    linears = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embed")]
    assert set(copies) == set(linears)
    for block in model.blocks:
        ffn = block.ffn
        assert ffn.gate_up_copy.shape == (96, 32)
        assert torch.equal(ffn.gate_up_copy, torch.cat([ffn.w1.weight, ffn.w3.weight]).bfloat16())
    other = TransformerLM(model.cfg)
    model.load_state_dict(other.state_dict())
    ffn, want = model.blocks[1].ffn, other.blocks[1].ffn
    assert torch.equal(ffn.gate_up_copy, torch.cat([want.w1.weight, want.w3.weight]).bfloat16())


@pytest.mark.slow  # training steps in the interpreter
def test_a_model_trains_with_the_fused_gate_up_under_cpu_autocast():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, vocab_size=11, context_length=8)
    model = TransformerLM(cfg)
    ids = torch.randint(0, 11, (4, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
