import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, TransformerLM
from training.parallel.activation_checkpointing import checkpoint_blocks

CFG = ModelConfig(d_model=32, n_layers=3, n_heads=2, d_ff=64, vocab_size=97, context_length=16)
ATTN = "naive"
# A full recomputation redoes qkv, out, w1 and w3 (fp64: w1 and w3 apart) and stops before w2, whose output the
# backward does not need; the naive attention's two matmuls are bmm.
REDONE_MATMULS = 4


class CountOps(TorchDispatchMode):
    """How many times each op runs inside the `with`."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def saved_bytes_and_grads(model: TransformerLM, ids: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward during the forward, and the gradients after backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).double().square().mean()
    n = sum(saved)
    loss.backward()
    return n, {name: p.grad for name, p in model.named_parameters()}


def backward_ops_and_grads(model: TransformerLM, ids: torch.Tensor) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """The ops the backward runs (recomputation included), and the gradients."""
    loss = model(ids).double().square().mean()
    with CountOps() as ops:
        loss.backward()
    return ops.counts, {name: p.grad for name, p in model.named_parameters()}


def pair(policy: str | None) -> tuple[TransformerLM, TransformerLM]:
    torch.manual_seed(0)
    plain = TransformerLM(CFG, ATTN).double()
    other = TransformerLM(CFG, ATTN).double()
    other.load_state_dict(plain.state_dict())
    if policy:
        checkpoint_blocks(other, policy)
        checkpoint_blocks(other, policy)  # a second call changes nothing
    return plain, other


@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 8)])
def test_recomputation_gives_the_same_gradients_with_less_saved(batch, seq):
    plain, recomputed = pair("full")
    ids = torch.randint(0, CFG.vocab_size, (batch, seq))
    plain_bytes, plain_grads = saved_bytes_and_grads(plain, ids)
    recomputed_bytes, recomputed_grads = saved_bytes_and_grads(recomputed, ids)
    for name, g in plain_grads.items():
        torch.testing.assert_close(recomputed_grads[name], g, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert recomputed_bytes < plain_bytes / 2, (recomputed_bytes, plain_bytes)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()  # checkpoints keep their names


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 8)])
def test_selective_recomputation_redoes_no_matmul(policy, batch, seq):
    """Both policies give the plain gradients; full redoes each block's forward matmuls in the backward, selective
    keeps their outputs (and attention's) and recomputes only the rest, such as the norms."""
    plain, recomputed = pair(policy)
    ids = torch.randint(0, CFG.vocab_size, (batch, seq))
    plain_ops, plain_grads = backward_ops_and_grads(plain, ids)
    ops, grads = backward_ops_and_grads(recomputed, ids)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    redone_mm = ops.get("mm", 0) - plain_ops.get("mm", 0)
    redone_bmm = ops.get("bmm", 0) - plain_ops.get("bmm", 0)
    if policy == "full":
        assert (redone_mm, redone_bmm) == (REDONE_MATMULS * CFG.n_layers, 2 * CFG.n_layers)
    else:
        assert (redone_mm, redone_bmm) == (0, 0)
    assert ops.get("rsqrt", 0) - plain_ops.get("rsqrt", 0) == 2 * CFG.n_layers  # both norms of each block redone


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown recomputation policy 'most'"):
        checkpoint_blocks(TransformerLM(CFG, ATTN), "most")


@pytest.mark.parametrize("policy, redone", [("full", CFG.n_layers), ("selective", 0)])
def test_selective_recomputation_keeps_flash_attention(policy, redone, monkeypatch):
    """The flash backend's attention, eager: full recomputation runs its forward again in the backward, selective keeps
    its output (the policy sees it as an operator)."""
    from attention import why_not
    from attention.flash import dispatch

    q = torch.randn(1, 2, 8, 16)
    if why_not("flash", q, q, q, True) is not None:
        pytest.skip(why_not("flash", q, q, q, True))
    calls = []
    for name in ("run_forward", "flash_forward"):
        original = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    torch.manual_seed(0)
    model = TransformerLM(CFG, "flash")
    checkpoint_blocks(model, policy)
    loss = model(torch.randint(0, CFG.vocab_size, (2, 16))).square().mean()
    forwards = len(calls)
    loss.backward()
    assert forwards == CFG.n_layers
    assert len(calls) - forwards == redone
