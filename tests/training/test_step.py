"""train.py and bench_model.py build their training step with the one recipe, training.step.build_step."""

import pytest
import torch

import bench_model
import train
from model import TransformerLM
from tests.training.resolved import resolved
from training.config import OptimConfig
from training.optim.overlapped import OverlappedOptimizer
from training.optim.registry import BETAS
from training.step import build_step

DIMS = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--vocab-size", "256",
        "--batch-size", "4", "--device", "cpu", "--attn", "sdpa"]


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(256, (4, 32), generator=g), torch.randint(256, (4, 32), generator=g)) for _ in range(n)]


def train_py_step(*flags: str):
    """The step train.py's Trainer builds from its flags (the model's vocabulary set from --vocab-size, as the Trainer
    sets it from the data)."""
    config = train.parse([*DIMS, "--context-length", "32", *flags]).config
    config = config.replace(model={"vocab_size": config.data.vocab_size})
    torch.manual_seed(0)
    return build_step(TransformerLM(config.model, config.execution.attn), config), config


def bench_model_runner(optimizer: str):
    """The runner bench_model.py builds for the same model and a train-step."""
    args = bench_model.parse_args([*DIMS, "--context-lengths", "32", "--mode", "train-step", "--optimizer", optimizer])
    (point,) = args.points
    torch.manual_seed(0)
    return bench_model.build_runner(point, args.device), point.config


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw-bf16", marks=pytest.mark.slow)])
def test_train_and_bench_model_steps_give_the_same_losses_and_weights(optimizer):
    # No clipping (bench_model times the step without it): the optimizer steps during the backward in both.
    step, train_config = train_py_step("--grad-clip", "0", "--optimizer", optimizer)
    runner, bench_config = bench_model_runner(optimizer)
    for section in ("model", "execution", "optim"):
        assert getattr(train_config, section) == getattr(bench_config, section), section
    assert isinstance(step.optimizer, OverlappedOptimizer) and isinstance(runner.train.optimizer, OverlappedOptimizer)
    for ids, targets in batches(3):
        before = runner.train.loss(ids, targets).detach()
        loss, grad_norm = step(ids, targets)
        assert torch.equal(loss, before)  # the same weights going into every step
        assert grad_norm is not None  # train.py logs it
        runner.step(ids, targets)
    trained = dict(step.model.named_parameters())
    benched = dict(runner.model.named_parameters())
    assert trained.keys() == benched.keys()
    for name, p in trained.items():
        assert torch.equal(p, benched[name]), name
    fresh = train_py_step("--grad-clip", "0", "--optimizer", optimizer)[0].model.parameters()
    moved = [not torch.equal(p, q) for p, q in zip(trained.values(), fresh)]
    assert all(moved)  # the steps did update every parameter


def test_the_optimizer_decays_matrices_only_with_the_shared_defaults():
    step, _ = train_py_step()
    hp = OptimConfig()
    decayed, plain = step.optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == hp.weight_decay
    assert all(p.dim() < 2 for p in plain["params"]) and plain["weight_decay"] == 0.0
    assert decayed["lr"] == hp.lr and decayed["betas"] == BETAS


@pytest.mark.parametrize("grad_clip", [0.0, 1.0], ids=["stepped-in-backward", "clipped"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-bf16", "muon"])
def test_the_embedding_steps_at_its_own_learning_rate_with_the_same_shrinkage(optimizer, grad_clip):
    """--embed-lr-scale 10: the embedding's first AdamW update is 10 times as large on the rows the batch uses (Adam's
    first step moves each entry by about lr), the rows it does not use shrink as without it, the rest is unchanged."""
    (ids, targets), = batches(1)
    moved = {}
    for scale in (1.0, 10.0):
        config = resolved(optim={"optimizer": optimizer, "embed_lr_scale": scale, "grad_clip": grad_clip})
        torch.manual_seed(0)
        step = build_step(TransformerLM(config.model), config)
        before = {name: p.detach().clone() for name, p in step.model.named_parameters()}
        step.set_lr(2e-3)
        step(ids, targets)
        moved[scale] = {name: p.detach() - before[name] for name, p in step.model.named_parameters()}
        lrs = {float(g["lr"]) for g in step.optimizer.param_groups if any(p is step.model.embed.weight
                                                                          for p in g["params"])}
        assert lrs == {2e-3 * scale}
    used = torch.zeros(256, dtype=torch.bool)
    used[ids.unique()] = True
    plain, scaled = moved[1.0].pop("embed.weight"), moved[10.0].pop("embed.weight")
    ratio = scaled[used].abs().mean() / plain[used].abs().mean()
    assert 9.0 < ratio < 10.5, ratio
    torch.testing.assert_close(scaled[~used], plain[~used], rtol=1e-5, atol=1e-12)
    for name, delta in moved[1.0].items():
        torch.testing.assert_close(moved[10.0][name], delta, rtol=0, atol=0, msg=name)


def test_the_step_reports_the_norm_before_clipping_and_clears_the_gradients():
    (ids, targets), = batches(1)
    norms = {}
    for clip in (0.0, 1e-3):
        config = resolved(optim={"grad_clip": clip})
        torch.manual_seed(0)
        step = build_step(TransformerLM(config.model), config)
        # Without clipping the optimizer steps during the backward; the norm is still that of the gradients.
        assert isinstance(step.optimizer, OverlappedOptimizer) == (clip == 0)
        _, norms[clip] = step(ids, targets)
        assert all(p.grad is None for p in step.model.parameters())  # cleared after the step
    torch.testing.assert_close(norms[0.0], norms[1e-3])
    assert norms[0.0] > 1e-3


def test_without_the_norm_asked_for_an_unclipped_step_computes_none():
    config = resolved(optim={"grad_clip": 0.0})
    step = build_step(TransformerLM(config.model), config, grad_norm=False)
    loss, norm = step(*batches(1)[0])
    assert norm is None and torch.isfinite(loss)
    clipped = resolved(optim={"grad_clip": 1.0})
    _, norm = build_step(TransformerLM(clipped.model), clipped, grad_norm=False)(*batches(1)[0])
    assert norm is not None and norm > 0  # clipping needs it anyway


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_accumulated_micro_batches_give_the_step_of_the_whole_batch(n):
    """--grad-accum-steps: the same losses, gradient norms and weights as one pass over the batch (fp32, clipped)."""
    results = []
    for accum in (1, n):
        step, config = train_py_step("--grad-clip", "0.3", "--grad-accum-steps", str(accum))
        assert config.execution.grad_accum_steps == accum
        out = [tuple(t.item() for t in step(x, y)) for x, y in batches(3)]
        results.append((out, {k: v.clone() for k, v in step.model.state_dict().items()}))
    (plain, plain_weights), (accumulated, weights) = results
    torch.testing.assert_close(accumulated, plain, rtol=1e-5, atol=1e-6)
    assert plain[0][1] > 0.3  # clipping acts, so it needs the norm of the summed gradients
    # AdamW divides by sqrt(v): an element whose gradient is near 0 turns summation-order noise into up to ~3% of
    # its 3 steps' movement (3 x lr = 1.8e-3), hence the absolute tolerance.
    for name, w in plain_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_activation_checkpointing_recomputes_every_block_of_the_step():
    config = resolved(execution={"activation_checkpointing": True})
    step = build_step(TransformerLM(config.model), config)
    assert all(getattr(block, "_recomputed_in_backward", False) for block in step.model.blocks)
    plain_config = resolved()
    torch.manual_seed(0)
    plain = build_step(TransformerLM(plain_config.model), plain_config)
    step.model.load_state_dict(plain.model.state_dict())
    for x, y in batches(2):
        (loss, norm), (want_loss, want_norm) = step(x, y), plain(x, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=1e-6)


def test_packed_documents_reach_the_model_and_are_split_with_the_micro_batches():
    """doc_ids (training/data/sampling.py's packed rows): one document per row is the plain causal step; documents cut
    inside the rows change the loss; accumulated micro-batches each take their rows' ids."""
    x, y = batches(1)[0]
    one_document = torch.zeros_like(x)
    cuts = torch.zeros_like(x, dtype=torch.bool)
    cuts[:, 8::8] = True
    documents = cuts.long().cumsum(-1)
    losses = {}
    for accum, ids in ((1, None), (1, one_document), (1, documents), (2, documents)):
        config = resolved(execution={"grad_accum_steps": accum})
        torch.manual_seed(0)
        step = build_step(TransformerLM(config.model), config)
        losses[accum, None if ids is None else int(ids.max())] = step(x, y, ids)
    torch.testing.assert_close(losses[1, 0], losses[1, None], rtol=1e-5, atol=1e-6)
    assert abs(losses[1, 3][0].item() - losses[1, None][0].item()) > 1e-3
    torch.testing.assert_close(losses[2, 3], losses[1, 3], rtol=1e-5, atol=1e-6)
