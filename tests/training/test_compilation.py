"""training.compilation: compiled regions give the eager loss and gradients, and all blocks share one compile."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from model import ModelConfig, TransformerLM
from training.parallel.activation_checkpointing import checkpoint_blocks
from training.compilation import compile_regions

CFG = ModelConfig(d_model=32, n_layers=3, n_heads=2, d_ff=64, vocab_size=97, context_length=16)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (2, 16), generator=g),
            torch.randint(0, CFG.vocab_size, (2, 16), generator=g))


def loss_and_grads(model: TransformerLM, ids: torch.Tensor, targets: torch.Tensor):
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or counts carried between tests
    yield
    torch._dynamo.reset()


# Without zero_init_residual: zero projections would make every block the identity and hide the rest from the gradients.
RECIPE_OPTIONS = ModelConfig(**{**CFG.to_dict(), "qk_norm": True, "mlp": "relu2", "logit_softcap": 15.0})


@pytest.mark.slow  # Inductor compiles the forward and the backward
@pytest.mark.parametrize("recompute, cfg", [(None, CFG), ("full", CFG), ("selective", CFG), (None, RECIPE_OPTIONS)],
                         ids=["plain", "activation-checkpointing", "selective-activation-checkpointing",
                              "recipe-options"])
def test_compiled_regions_give_the_eager_loss_and_gradients(recompute, cfg):
    torch.manual_seed(0)
    eager, compiled = TransformerLM(cfg), TransformerLM(cfg)
    compiled.load_state_dict(eager.state_dict())
    if recompute:
        checkpoint_blocks(compiled, recompute)
    assert compile_regions(compiled) is compiled  # Inductor, as train.py uses it
    ids, targets = batch()
    want_loss, want_grads = loss_and_grads(eager, ids, targets)
    got_loss, got_grads = loss_and_grads(compiled, ids, targets)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # The logits path runs the same compiled blocks (with grad on: no-grad graphs would be more compiles to wait for).
    torch.testing.assert_close(compiled(ids).detach(), eager(ids).detach(), rtol=1e-5, atol=1e-5)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints keep their names


# Dynamo alone (a counting backend): one block without checkpointing is quick; the other cases run with -m slow.
@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "activation-checkpointing"])
@pytest.mark.parametrize("n_layers", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_identical_blocks_share_one_compile(n_layers, recompute):
    """One Dynamo compile for all the blocks, one for the loss, whatever the depth; none more on later steps."""
    model = TransformerLM(ModelConfig(**{**CFG.to_dict(), "n_layers": n_layers}))
    if recompute:  # nn.Module.compile() would compile nothing here: torch.utils.checkpoint is Dynamo-disabled
        checkpoint_blocks(model)
    counter = CompileCounter()
    compile_regions(model, backend=counter)
    compile_regions(model, backend=counter)  # a second call changes nothing
    ids, targets = batch()
    model(ids)  # logits: the blocks only
    assert counter.frame_count == 1
    assert counter.op_count > 0
    for seed in range(3):  # later steps reuse the compiled code
        model(*batch(seed)).backward()
    assert counter.frame_count == 2  # + loss_from_hidden


@pytest.mark.slow  # Dynamo traces the whole model
def test_whole_model_compile_does_not_recompile_on_later_steps():
    model, counter = TransformerLM(CFG), CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=False)
    for seed in range(3):
        compiled(*batch(seed)).backward()
    assert counter.frame_count == 1
