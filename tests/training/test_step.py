"""train.py and bench_model.py build their training step with the one recipe, training.step.build_step."""

import pytest
import torch

import bench_model
import train
from model import TransformerLM
from training.step import OptimizerConfig, StepConfig, build_step

DIMS = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--vocab-size", "256",
        "--batch-size", "4", "--device", "cpu", "--attn", "sdpa"]


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(256, (4, 32), generator=g), torch.randint(256, (4, 32), generator=g)) for _ in range(n)]


def train_py_step(overlap: bool, state: str = "fp32"):
    """The step train.py builds from its flags (its default AdamW; no clipping, as bench_model times it)."""
    parser = train.build_parser()
    args = parser.parse_args([*DIMS, "--context-length", "32", "--grad-clip", "0", "--optim-state-dtype", state,
                              *(["--overlap-optimizer"] if overlap else [])])
    train.check_args(parser, args)
    cfg = train.model_config(args, args.vocab_size)
    torch.manual_seed(0)
    return build_step(TransformerLM(cfg), train.step_config(args)), cfg


def bench_model_runner(overlap: bool, state: str = "fp32"):
    """The runner bench_model.py builds for the same model and a train-step."""
    args = bench_model.parse_args([*DIMS, "--context-lengths", "32", "--mode", "train-step",
                                   "--overlap-optimizer", "on" if overlap else "off", "--optim-state-dtype", state])
    (point,) = bench_model.sweep_points(args)
    torch.manual_seed(0)
    return bench_model.build_runner(point, args.device), point.cfg


@pytest.mark.parametrize("state", ["fp32", "bf16"], ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize("overlap", [False, True], ids=["adamw", "overlap-optimizer"])
def test_train_and_bench_model_steps_give_the_same_losses_and_weights(overlap, state):
    step, train_cfg = train_py_step(overlap, state)
    runner, bench_cfg = bench_model_runner(overlap, state)
    assert train_cfg == bench_cfg
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
    moved = [not torch.equal(p, q)
             for p, q in zip(trained.values(), train_py_step(overlap, state)[0].model.parameters())]
    assert all(moved)  # the steps did update every parameter


def test_the_optimizer_decays_matrices_only_with_the_shared_defaults():
    step, _ = train_py_step(overlap=False)
    hp = OptimizerConfig()
    decayed, plain = step.optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == hp.weight_decay
    assert all(p.dim() < 2 for p in plain["params"]) and plain["weight_decay"] == 0.0
    assert decayed["lr"] == hp.lr and decayed["betas"] == hp.betas


def test_the_step_reports_the_norm_before_clipping_and_clears_the_gradients():
    torch.manual_seed(0)
    cfg = train.model_config(train.build_parser().parse_args([*DIMS, "--context-length", "32"]), 256)
    (ids, targets), = batches(1)
    norms = {}
    for clip in (0.0, 1e-3):
        torch.manual_seed(0)
        step = build_step(TransformerLM(cfg), StepConfig(optimizer=OptimizerConfig(grad_clip=clip)))
        _, norms[clip] = step(ids, targets)
        assert all(p.grad is None for p in step.model.parameters())  # cleared after the step
    torch.testing.assert_close(norms[0.0], norms[1e-3])
    assert norms[0.0] > 1e-3


@pytest.mark.parametrize("n", [2, 4])
def test_accumulated_micro_batches_give_the_step_of_the_whole_batch(n):
    """--grad-accum-steps: the same losses, gradient norms and weights as one pass over the batch (fp32, clipped)."""
    parser = train.build_parser()
    results = []
    for accum in (1, n):
        args = parser.parse_args([*DIMS, "--context-length", "32", "--grad-clip", "0.3", "--grad-accum-steps",
                                  str(accum)])
        train.check_args(parser, args)
        torch.manual_seed(0)
        model = TransformerLM(train.model_config(args, args.vocab_size))
        step = build_step(model, train.step_config(args))
        out = [tuple(t.item() for t in step(x, y)) for x, y in batches(3)]
        results.append((out, {k: v.clone() for k, v in model.state_dict().items()}))
    (plain, plain_weights), (accumulated, weights) = results
    torch.testing.assert_close(accumulated, plain, rtol=1e-5, atol=1e-6)
    assert plain[0][1] > 0.3  # clipping acts, so it needs the norm of the summed gradients
    # AdamW divides by sqrt(v): an element whose gradient is near 0 turns summation-order noise into up to ~3% of
    # its 3 steps' movement (3 x lr = 1.8e-3), hence the absolute tolerance.
    for name, w in plain_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_micro_batches_must_divide_the_batch():
    step = build_step(TransformerLM(train.model_config(train.build_parser().parse_args(DIMS), 256)),
                      StepConfig(grad_accum_steps=3))
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="grad_accum_steps 3 must divide the batch of 4 sequences"):
        step(x, y)
