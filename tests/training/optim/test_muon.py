"""training/optim/muon.py: torch.optim.Muon for the blocks' matrices and AdamW for the rest, driven as one optimizer
by the training step (clipping, learning rate, zero_grad), saved and resumed by parameter name like the others, and
declared so that resolve() keeps it out of CUDA graphs, FSDP and the backward."""

from __future__ import annotations

import pytest
import torch

from model import TransformerLM
from tests.training.resolved import resolved
from training.checkpoint import files as checkpoint_files
from training.checkpoint.resume import ResumeError, load_checkpoint, optimizers_of, save_checkpoint
from training.config import (ConfigError, ExecutionConfig, _check_combinations, _speed_defaults, overlaps_backward,
                             resolve)
from training.optim import get_optimizer
from training.optim.muon import MuonAdamW, hidden_matrices
from training.parallel.distributed import DistContext
from training.step import build_step

CUDA = torch.device("cuda")
MATRICES = {f"blocks.{i}.{name}.weight" for i in range(2) for name in ("attn.qkv", "attn.out", "ffn.w1", "ffn.w2",
                                                                         "ffn.w3")}


def muon_step(seed: int = 0, **optim):
    config = resolved(optim={"optimizer": "muon", "lr": 2e-3, **optim}, run={"steps": 10})
    torch.manual_seed(seed)
    return build_step(TransformerLM(config.model, config.execution.attn), config)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(256, (4, 33), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def names(model: torch.nn.Module, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def test_muon_takes_the_blocks_matrices_and_adamw_the_embedding_head_and_gains():
    step = muon_step()
    assert isinstance(step.optimizer, MuonAdamW)
    muon, adamw = step.optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert names(step.model, muon.param_groups[0]["params"]) == MATRICES
    decayed, gains = adamw.param_groups
    assert names(step.model, decayed["params"]) == {"embed.weight", "lm_head.weight"}
    assert names(step.model, gains["params"]) == {n for n, p in step.model.named_parameters() if p.dim() == 1}
    assert (decayed["weight_decay"], gains["weight_decay"]) == (0.1, 0.0)
    # The documented hyper-parameters: Moonshot's AdamW-matched RMS, Keller Jordan's momentum and Newton-Schulz.
    group = muon.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"], group["ns_steps"],
            group["adjust_lr_fn"]) == (2e-3, 0.1, 0.95, True, 5, "match_rms_adamw")
    assert hidden_matrices(step.model, list(step.model.parameters()))[0] == muon.param_groups[0]["params"]


def test_the_declarations_keep_it_out_of_graphs_fsdp_and_the_backward():
    spec = get_optimizer("muon")
    assert (spec.capturable, spec.shards, spec.steps_in_backward, spec.state_layout) == (False, False, False, "muon")
    ex, choices = _speed_defaults(ExecutionConfig(), CUDA, "muon")
    assert not ex.cuda_graph and ex.compile == torch._dynamo.is_dynamo_supported()
    assert "no CUDA graph (not captured with --optimizer muon, whose step reads its learning rate on the host)" in choices
    graphed = resolved(optim={"optimizer": "muon"}).replace(execution={"cuda_graph": True, "dtype": "bf16"})
    with pytest.raises(ConfigError, match=r"^--cuda-graph: not captured with --optimizer muon, whose step reads its "
                                          r"learning rate on the host$"):
        _check_combinations(graphed, CUDA, 1)
    with pytest.raises(ConfigError, match=r"^--optimizer muon updates whole parameters; --parallel fsdp"):
        resolve(resolved(optim={"optimizer": "muon"}).replace(execution={"parallel": "fsdp"}), world_size=2)
    ddp = resolve(resolved().replace(optim={"optimizer": "muon"}, execution={"parallel": "ddp"}), world_size=2)
    assert ddp.config.execution.parallel == "ddp"
    assert not overlaps_backward(resolved(optim={"optimizer": "muon", "grad_clip": 0.0}))
    assert isinstance(muon_step(grad_clip=0.0).optimizer, MuonAdamW)  # unclipped, still stepped after the backward


def test_a_step_is_muon_and_adamw_applied_to_the_clipped_gradients():
    """The combined step equals torch.optim.Muon and torch.optim.AdamW, built by hand with the same settings, on
    gradients scaled by the clipping coefficient; set_lr reaches both parts."""
    step = muon_step(grad_clip=0.05)
    step.set_lr(3e-3)
    assert {g["lr"] for g in step.optimizer.param_groups} == {3e-3}
    reference = TransformerLM(step.config.model, step.config.execution.attn)
    reference.load_state_dict(step.model.state_dict())
    matrices, rest = hidden_matrices(reference, list(reference.parameters()))
    muon = torch.optim.Muon(matrices, lr=3e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for seed in (1, 2):
        x, y = batch(seed)
        loss, norm = step(x, y)
        reference(x, y).backward()
        coef = torch.clamp(0.05 / (norm + 1e-6), max=1.0)
        assert coef < 1  # clipping acted
        for p in reference.parameters():
            p.grad.mul_(coef)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        for (name, got), want in zip(step.model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    assert all(p.grad is None for p in step.model.parameters())


@pytest.mark.slow  # many optimizer steps
def test_it_learns_a_batch():
    step = muon_step(lr=1e-2)
    x, y = batch()
    losses = [step(x, y)[0].item() for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0, losses


def test_a_checkpoint_resumes_with_the_same_state_and_the_same_next_step(tmp_path):
    a = muon_step(seed=0)
    for seed in (1, 2):
        a(*batch(seed))
    path = save_checkpoint(tmp_path, a.model, a.optimizer, a.scaler, 2, a.config)
    state = checkpoint_files.load_file(path)["optimizer"]["state"]
    assert set(state) == {n for n, _ in a.model.named_parameters()}, "keyed by parameter name"
    assert {n for n, s in state.items() if set(s) == {"momentum_buffer"}} == MATRICES
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for n, s in state.items() if n not in MATRICES)

    b = muon_step(seed=1)
    resumed = load_checkpoint(tmp_path, b.model, b.optimizer, b.scaler, b.config, DistContext(), pytest.fail)
    assert resumed.step == 2
    for opt_a, opt_b in zip(optimizers_of(a.optimizer), optimizers_of(b.optimizer)):
        for p, q in zip((p for g in opt_a.param_groups for p in g["params"]),
                        (q for g in opt_b.param_groups for q in g["params"])):
            assert torch.equal(p, q)
            for key, value in opt_a.state[p].items():
                assert torch.equal(torch.as_tensor(opt_b.state[q][key]), torch.as_tensor(value)), key
    x, y = batch(3)
    assert torch.equal(a(x, y)[0], b(x, y)[0])
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_of_another_state_layout_is_refused_in_one_line(tmp_path):
    adamw = muon_step().config.replace(optim={"optimizer": "adamw"})
    torch.manual_seed(0)
    model = TransformerLM(adamw.model, adamw.execution.attn)
    step = build_step(model, adamw)
    step(*batch())
    path = save_checkpoint(tmp_path, model, step.optimizer, step.scaler, 1, adamw)
    b = muon_step()
    with pytest.raises(ResumeError, match=rf"^checkpoint {path} holds the state of --optimizer adamw, which "
                                          r"--optimizer muon cannot continue from: resume with --optimizer adamw, or "
                                          r"start a new run$"):
        load_checkpoint(tmp_path, b.model, b.optimizer, b.scaler, b.config, DistContext(), pytest.fail)


def test_its_own_state_dict_round_trips():
    a, b = muon_step(seed=0), muon_step(seed=0)
    a(*batch())
    b.optimizer.load_state_dict(a.optimizer.state_dict())
    b.model.load_state_dict(a.model.state_dict())
    x, y = batch(2)
    assert torch.equal(a(x, y)[0], b(x, y)[0])
    with pytest.raises(ValueError, match="not a MuonAdamW's"):
        b.optimizer.load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.slow  # train.py runs and resumes
def test_train_py_with_the_muon_recipe_resumes_as_if_never_stopped(tmp_path, text_file):
    """train.py --config muon for 6 steps, against 4 steps then --resume to 6: the same losses and weights (a flat
    learning rate after the warm-up, so that the 4-step run's schedule is the 6-step run's)."""
    import json

    import train
    from training.checkpoint import files as checkpoint_files

    tiny = ["--config", "muon", "--lr", "2e-3", "--min-lr", "2e-3", "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--d-ff", "64", "--context-length", "16", "--batch-size", "4", "--device", "cpu",
            "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "2", "--ckpt-every", "2",
            "--wandb", "disabled", "--data", str(text_file)]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train.main([*tiny, "--steps", "6", "--out", str(whole)]) == 0
    assert train.main([*tiny, "--steps", "4", "--out", str(split)]) == 0
    assert train.main(["--resume", "--steps", "6", "--out", str(split), "--wandb", "disabled"]) == 0

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses(split) == losses(whole) and len(losses(whole)) == 6
    assert json.loads((split / "config.json").read_text())["optim"]["optimizer"] == "muon"
    a, b = (checkpoint_files.load_file(out / checkpoint_files.checkpoint_name(6)) for out in (whole, split))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
