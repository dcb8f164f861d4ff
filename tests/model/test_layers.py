import math

import pytest
import torch
import torch.nn.functional as F

from model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU
from tests.conftest import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_formula_and_keeps_dtype(dtype):
    norm = RMSNorm(48)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 5, 48).to(dtype)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    got = norm(x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_swiglu_matches_formula():
    ffn = SwiGLU(32, 80)
    x = torch.randn(4, 7, 32)
    w1, w2, w3 = (m.weight.double() for m in (ffn.w1, ffn.w2, ffn.w3))
    h = x.double() @ w1.T
    want = (h * torch.sigmoid(h) * (x.double() @ w3.T)) @ w2.T
    torch.testing.assert_close(ffn(x).double(), want, atol=1e-5, rtol=1e-5)


def test_rope_rotates_pairs_by_position_angle():
    d, seq, theta = 16, 11, 10_000.0
    rope = RotaryEmbedding(d, theta)
    x = torch.randn(2, seq, d)
    got = rope(x).double()
    want = torch.empty_like(got)
    for pos in range(seq):
        for i in range(d // 2):
            angle = pos * theta ** (-2 * i / d)
            a, b = x[:, pos, 2 * i].double(), x[:, pos, 2 * i + 1].double()
            want[:, pos, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            want[:, pos, 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(32)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    seq = 40
    qs = rope(q.float().expand(seq, 32).contiguous()).double()  # the same vector at every position
    ks = rope(k.float().expand(seq, 32).contiguous()).double()
    scores = qs @ ks.T  # (seq, seq)
    for offset in (0, 3, 17):
        diag = torch.diagonal(scores, offset=-offset)  # q position i, k position i - offset
        torch.testing.assert_close(diag, diag[0].expand_as(diag), atol=1e-4, rtol=1e-4)


def test_rope_tables_are_buffers_outside_checkpoints():
    rope = RotaryEmbedding(8, max_seq_len=12)
    assert rope.cos.shape == rope.sin.shape == (12, 4) and rope.cos.dtype == torch.float32
    assert dict(rope.named_buffers()).keys() == {"cos", "sin"} and rope.state_dict() == {}
    x = torch.randn(3, 12, 8)
    torch.testing.assert_close(rope(x[:, 5:], positions=torch.arange(5, 12)), rope(x)[:, 5:])  # rows by position
    with pytest.raises(ValueError, match="RoPE tables cover 12 positions; got a sequence of 13"):
        rope(torch.randn(13, 8))
    with pytest.raises(ValueError, match="positions < 12; got 12"):
        rope(x, positions=torch.arange(1, 13))  # 12 positions, the last out of range


@pytest.mark.parametrize("positions", [None, torch.arange(3, 10)])
def test_rope_with_seq_before_the_heads_matches_the_heads_first_layout(positions):
    """(batch, seq, heads, d) with seq_dim=-3 rotates as (batch, heads, seq, d) does, from the same tables."""
    rope = RotaryEmbedding(16, max_seq_len=12)
    x = torch.randn(2, 7, 3, 16)  # (batch, seq, heads, d_head)
    got = rope(x, positions=positions, seq_dim=-3)
    want = rope(x.transpose(1, 2), positions=positions).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got.is_contiguous()  # a fresh (batch, seq, heads, d) tensor: the attention module relies on this order
    with pytest.raises(ValueError, match="seq_dim must be -2 or further left"):
        rope(x, seq_dim=-1)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even d_head"):
        RotaryEmbedding(7)


def test_linear_init_is_truncated_normal_with_fan_std():
    lin = Linear(512, 1536)
    std = math.sqrt(2 / (512 + 1536))
    w = lin.weight.detach()
    assert abs(w.std().item() - std * 0.986) < 0.02 * std  # a normal cut at +-3 std keeps 0.986 of its std
    assert w.abs().max().item() <= 3 * std + 1e-6


class AutocastLinear(torch.nn.Module):
    """The reference: plain autocast (F.linear), whose weight gradient comes out in the low dtype and is cast to fp32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _linear_pair(d_in: int, d_out: int) -> tuple[Linear, AutocastLinear]:
    """The same weights twice: ours (fp32 weight gradients), and plain autocast (F.linear)."""
    ours = Linear(d_in, d_out).to(DEVICE)
    return ours, AutocastLinear(ours.weight)


def _forward_backward(lin: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast_dtype, compiled: bool = False):
    x = x.detach().clone().requires_grad_()
    lin.weight.grad = None
    fn = torch.compile(lin, dynamic=False) if compiled else lin
    with torch.autocast(DEVICE, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        y = fn(x)
    y.backward(dy)
    return y, x.grad, lin.weight.grad


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 17, 48), (40, 48)])
def test_linear_fp32_weight_grad_under_autocast(shape, autocast_dtype, x_dtype):
    # y and dX are autocast's, bitwise; dW is the fp32 product of the low-dtype dY and X, unrounded.
    ours, plain = _linear_pair(48, 80)
    x = torch.randn(shape, device=DEVICE).to(x_dtype)
    dy = torch.randn(*shape[:-1], 80, device=DEVICE).to(autocast_dtype)
    y, dx, dw = _forward_backward(ours, x, dy, autocast_dtype)
    y_ref, dx_ref, dw_plain = _forward_backward(plain, x, dy, autocast_dtype)
    assert y.dtype == autocast_dtype and torch.equal(y, y_ref)
    assert dx.dtype == x_dtype and torch.equal(dx, dx_ref)
    assert dw.dtype == torch.float32
    want = dy.double().flatten(0, -2).T @ x.to(autocast_dtype).double().flatten(0, -2)
    err = ((dw.double() - want).abs().max() / want.abs().max()).item()
    err_plain = ((dw_plain.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-6, err  # fp32 accumulation of exact products
    assert err_plain > 1e-4, err_plain  # autocast rounds dW to the low dtype: the test can tell the two apart


def test_linear_fp32_weight_grad_without_autocast_is_plain_linear():
    ours, plain = _linear_pair(32, 24)
    x, dy = torch.randn(5, 32, device=DEVICE), torch.randn(5, 24, device=DEVICE)
    for got, want in zip(_forward_backward(ours, x, dy, None), _forward_backward(plain, x, dy, None)):
        assert torch.equal(got, want)


@pytest.mark.slow  # torch.compile
def test_linear_fp32_weight_grad_compiles():
    # Dynamo traces the autograd Function and its backward into the compiled graphs: same values as eager.
    ours, _ = _linear_pair(64, 96)
    x = torch.randn(4, 16, 64, device=DEVICE)
    dy = torch.randn(4, 16, 96, device=DEVICE).bfloat16()
    eager = _forward_backward(ours, x, dy, torch.bfloat16)
    compiled = _forward_backward(ours, x, dy, torch.bfloat16, compiled=True)
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    want = dy.double().flatten(0, -2).T @ x.bfloat16().double().flatten(0, -2)
    assert ((compiled[2].double() - want).abs().max() / want.abs().max()).item() < 1e-6  # still fp32 dW


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_kept_weight_copy_gives_the_cast_weights_results(dtype):
    # The forward reads the copy instead of casting: outputs and both gradients bitwise the same.
    ours, _ = _linear_pair(48, 80)
    with_copy, _ = _linear_pair(48, 80)
    with torch.no_grad():
        with_copy.weight.copy_(ours.weight)
    low = with_copy.keep_weight_copy(dtype)
    assert low.dtype == dtype and torch.equal(low, ours.weight.detach().to(dtype))
    x, dy = torch.randn(3, 7, 48, device=DEVICE), torch.randn(3, 7, 80, device=DEVICE).to(dtype)
    for got, want in zip(_forward_backward(with_copy, x, dy, dtype), _forward_backward(ours, x, dy, dtype)):
        assert torch.equal(got, want)
    # The forward reads the copy, not the weight: a stale copy shows (so keeping it current matters).
    with torch.no_grad():
        low.zero_()
    assert _forward_backward(with_copy, x, dy, dtype)[0].abs().max() == 0


def test_loading_a_state_dict_refreshes_the_weight_copy():
    lin = Linear(16, 8).to(DEVICE)
    low = lin.keep_weight_copy(torch.bfloat16)
    other = Linear(16, 8).to(DEVICE)
    holder = torch.nn.Sequential(lin)
    holder.load_state_dict(torch.nn.Sequential(other).state_dict())
    assert torch.equal(low, other.weight.detach().bfloat16()) and lin.weight_copy is low


def test_a_weight_copy_needs_the_fp32_weight_gradient_path():
    # Only an fp32 weight goes through the fp32-weight-gradient path that reads the copy.
    with pytest.raises(ValueError, match="read by the fp32-weight-gradient path only: this layer has a "
                                         "torch.bfloat16 weight"):
        Linear(16, 8).to(torch.bfloat16).keep_weight_copy(torch.bfloat16)
    with pytest.raises(ValueError, match=r"a weight copy of \(8, 16\) in torch.bfloat16 cannot live in a \(16, 8\)"):
        Linear(16, 8).keep_weight_copy(torch.bfloat16, storage=torch.empty(16, 8, dtype=torch.bfloat16))


def test_embedding_init_cut_at_three():
    emb = Embedding(1000, 64)
    w = emb.weight.detach()
    assert w.abs().max().item() <= 3.0 and abs(w.std().item() - 0.986) < 0.02
    ids = torch.randint(0, 1000, (2, 5))
    torch.testing.assert_close(emb(ids), w[ids])
