"""model.fused_rope: the split of the qkv projection with RoPE, its Triton kernels against a float64 reference."""

import os

import pytest
import torch

from model import fused_rope
from model.config import ModelConfig
from model.layers import RotaryEmbedding
from model import transformer
from model.transformer import TransformerLM

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or the Triton interpreter")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def reference(qkv, n_heads, n_kv_heads, cos, sin):
    """float64 q, k, v: pairs (x[2i], x[2i+1]) of q and k rotated by the angle whose cos and sin are given."""
    x = qkv.double()
    d = x.shape[-1] // (n_heads + 2 * n_kv_heads)
    heads = x.unflatten(-1, (n_heads + 2 * n_kv_heads, d))
    cos, sin = cos.double()[..., None, :], sin.double()[..., None, :]
    even, odd = heads[..., 0::2], heads[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return rotated[:, :, :n_heads], rotated[:, :, n_heads:n_heads + n_kv_heads], heads[:, :, n_heads + n_kv_heads:]


def angles(batch, seq, d_head, per_row, device):
    """cos and sin of RoPE's angles: the table's first `seq` positions, or random positions per batch row."""
    rope = RotaryEmbedding(d_head, max_seq_len=4 * seq)
    if not per_row:
        return rope.cos[:seq].to(device), rope.sin[:seq].to(device)
    positions = torch.randint(0, 4 * seq, (batch, seq))
    return rope.cos[positions].to(device), rope.sin[positions].to(device)


# (batch, seq, heads, kv heads, d_head): MHA, GQA, MQA, a d_head whose half is no power of two, ragged lengths.
SHAPES = [(2, 17, 4, 4, 16), (1, 100, 6, 2, 32), (3, 9, 4, 1, 64), (2, 33, 3, 3, 80)]
# In the interpreter the two larger ones take about a second a case: they run with -m slow.
KERNEL_SHAPES = [SHAPES[0], pytest.param(SHAPES[1], marks=pytest.mark.slow), SHAPES[2],
                 pytest.param(SHAPES[3], marks=pytest.mark.slow)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * CUDA)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_the_forward_kernel_rotates_q_and_k_and_copies_v(shape, per_row, dtype):
    b, s, h, kv, d = shape
    qkv = torch.randn(b, s, (h + 2 * kv) * d).to(KERNEL_DEVICE, dtype)
    cos, sin = angles(b, s, d, per_row, KERNEL_DEVICE)
    outs = fused_rope.launch_split_rotate(qkv, h, kv, cos, sin)
    for name, out, want in zip("qkv", outs, reference(qkv, h, kv, cos, sin)):
        assert out.is_contiguous() and out.dtype == dtype, name
        # fp32 math, one rounding to the output dtype
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(out.double(), want, **tol, msg=lambda m: f"{name}: {m}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * CUDA)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_the_backward_kernel_is_the_gradient_of_the_reference(shape, per_row, dtype):
    b, s, h, kv, d = shape
    qkv = torch.randn(b, s, (h + 2 * kv) * d, dtype=torch.float64, requires_grad=True)
    cos, sin = angles(b, s, d, per_row, "cpu")
    grads = [torch.randn(b, s, n, d).to(dtype).double() for n in (h, kv, kv)]  # values the kernel can read
    want, = torch.autograd.grad(reference(qkv, h, kv, cos, sin), qkv, grads)
    # Gradients as attention returns them: dq in (batch, heads, seq, d_head) memory, dk and dv in (batch, seq, ...).
    dq = grads[0].to(KERNEL_DEVICE, dtype).transpose(1, 2).contiguous().transpose(1, 2)
    dk, dv = (g.to(KERNEL_DEVICE, dtype) for g in grads[1:])
    got = fused_rope.launch_merge_rotate_back(dq, dk, dv, cos.to(KERNEL_DEVICE), sin.to(KERNEL_DEVICE))
    assert got.shape == qkv.shape and got.is_contiguous() and got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got.double().cpu(), want, **tol)


def test_the_pytorch_path_matches_the_reference_and_runs_off_cuda():
    b, s, h, kv, d = 2, 12, 4, 2, 16
    qkv = torch.randn(b, s, (h + 2 * kv) * d)
    cos, sin = angles(b, s, d, True, "cpu")
    for got, want in zip(fused_rope.split_rotate(qkv, h, kv, cos, sin), reference(qkv, h, kv, cos, sin)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_angles_for_another_length_or_a_projection_of_another_width_are_refused():
    rope = RotaryEmbedding(16, max_seq_len=32)
    qkv = torch.randn(2, 10, 6 * 16)
    with pytest.raises(ValueError, match="angles for 10 positions"):
        fused_rope.split_rotate(qkv, 2, 2, rope.cos[:9], rope.sin[:9])
    with pytest.raises(ValueError, match="d_head 16"):
        fused_rope.split_rotate(qkv, 3, 2, rope.cos[:10], rope.sin[:10])


def test_a_block_refuses_a_sequence_longer_than_its_rope_tables():
    attention = TransformerLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=11,
                                          context_length=8)).blocks[0].attn
    with pytest.raises(ValueError, match="RoPE tables cover 8 positions; got a sequence of 9"):
        attention(torch.randn(1, 9, 32))


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_the_cuda_op_and_its_gradient_match_pytorch_eager_and_compiled(shape, compiled):
    b, s, h, kv, d = shape
    qkv = torch.randn(b, s, (h + 2 * kv) * d, device="cuda", requires_grad=True)
    cos, sin = angles(b, s, d, True, "cuda")
    split = torch.compile(fused_rope.split_rotate, fullgraph=True) if compiled else fused_rope.split_rotate
    ours = split(qkv, h, kv, cos, sin)
    want = fused_rope.split_rotate_reference(qkv, h, kv, cos, sin)
    grads = [torch.randn_like(t) for t in want]
    for got, ref in zip(ours + torch.autograd.grad(ours, qkv, grads),
                        want + torch.autograd.grad(want, qkv, grads)):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@needs_cuda
def test_the_compiled_op_takes_new_batch_and_sequence_sizes():
    split = torch.compile(fused_rope.split_rotate, dynamic=True)
    rope = RotaryEmbedding(32, max_seq_len=64).cuda()
    for b, s in ((2, 16), (3, 40), (1, 64)):
        qkv = torch.randn(b, s, 6 * 32, device="cuda")
        for got, want in zip(split(qkv, 2, 2, rope.cos[:s], rope.sin[:s]),
                             fused_rope.split_rotate_reference(qkv, 2, 2, rope.cos[:s], rope.sin[:s])):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
def test_a_model_trains_the_same_with_the_kernels_as_with_pytorch_ops(packed, monkeypatch):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=97, context_length=64)
    fused = TransformerLM(cfg, "flash").cuda()
    plain = TransformerLM(cfg, "flash").cuda()
    plain.load_state_dict(fused.state_dict())
    ids = torch.randint(0, 97, (3, 64), device="cuda")
    doc_ids = torch.cumsum(torch.rand(3, 64, device="cuda") < 0.1, dim=-1) if packed else None
    calls = []
    kernel = fused_rope._split_rotate_op
    monkeypatch.setattr(fused_rope, "_split_rotate_op", lambda *a: (calls.append(1), kernel(*a))[1])
    losses = []
    for model in (fused, plain):
        if model is plain:  # the attention layers' split_rotate, in PyTorch ops
            monkeypatch.setattr(transformer, "split_rotate", fused_rope.split_rotate_reference)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(ids, ids, doc_ids=doc_ids)
        loss.backward()
        losses.append(loss)
    assert len(calls) == cfg.n_layers  # the first model ran the kernels, the second did not
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-4, msg=lambda m: f"{name}: {m}")
