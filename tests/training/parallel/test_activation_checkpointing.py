import pytest
import torch

from model import ModelConfig, TransformerLM
from training.parallel.activation_checkpointing import checkpoint_blocks

CFG = ModelConfig(d_model=32, n_layers=3, n_heads=2, d_ff=64, vocab_size=97, context_length=16)
ATTN = "naive"


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


@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 8)])
def test_recomputation_gives_the_same_gradients_with_less_saved(batch, seq):
    torch.manual_seed(0)
    plain = TransformerLM(CFG, ATTN).double()
    recomputed = TransformerLM(CFG, ATTN).double()
    recomputed.load_state_dict(plain.state_dict())
    checkpoint_blocks(recomputed)
    checkpoint_blocks(recomputed)  # a second call changes nothing
    ids = torch.randint(0, CFG.vocab_size, (batch, seq))
    plain_bytes, plain_grads = saved_bytes_and_grads(plain, ids)
    recomputed_bytes, recomputed_grads = saved_bytes_and_grads(recomputed, ids)
    for name, g in plain_grads.items():
        torch.testing.assert_close(recomputed_grads[name], g, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert recomputed_bytes < plain_bytes / 2, (recomputed_bytes, plain_bytes)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()  # checkpoints keep their names
