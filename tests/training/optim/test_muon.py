"""training/optim/muon.py: Muon (torch.optim.Muon's update, batched per shape) for the blocks' matrices and AdamW for
the rest, driven as one optimizer by the training step (clipping, learning rate, zero_grad), saved and resumed by
parameter name like the others, captured in CUDA graphs, and declared so that resolve() keeps it out of FSDP and the
backward."""

from __future__ import annotations

import copy

import pytest
import torch

from model import TransformerLM
from tests.training.resolved import resolved
from training.checkpoint import files as checkpoint_files
from training.checkpoint.resume import ResumeError, load_checkpoint, optimizers_of, save_checkpoint
from training.config import (ConfigError, ExecutionConfig, _check_combinations, _speed_defaults, overlaps_backward,
                             resolve)
from training.optim import get_optimizer
from training.optim.muon import GroupedMuon, MuonAdamW, hidden_matrices, newton_schulz
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
    assert isinstance(muon, GroupedMuon) and isinstance(adamw, torch.optim.AdamW)
    assert names(step.model, muon.param_groups[0]["params"]) == MATRICES
    decayed, gains = adamw.param_groups
    assert names(step.model, decayed["params"]) == {"embed.weight", "lm_head.weight"}
    assert names(step.model, gains["params"]) == {n for n, p in step.model.named_parameters() if p.dim() == 1}
    assert (decayed["weight_decay"], gains["weight_decay"]) == (0.1, 0.0)
    # The documented hyper-parameters: Moonshot's AdamW-matched RMS, Keller Jordan's momentum and Newton-Schulz.
    group = muon.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"], group["ns_steps"],
            group["adjust_lr_fn"], group["ns_coefficients"], group["eps"]) == (
        2e-3, 0.1, 0.95, True, 5, "match_rms_adamw", (3.4445, -4.7750, 2.0315), 1e-7)
    assert muon.ns_dtype == torch.bfloat16
    assert hidden_matrices(step.model, list(step.model.parameters()))[0] == muon.param_groups[0]["params"]


def test_the_declarations_graph_it_and_keep_it_out_of_fsdp_and_the_backward():
    spec = get_optimizer("muon")
    assert (spec.capturable, spec.shards, spec.steps_in_backward, spec.state_layout) == (True, False, False, "muon")
    ex, choices = _speed_defaults(ExecutionConfig(), CUDA, "muon")
    assert ex.cuda_graph and "each step replayed as one CUDA graph" in choices, choices
    _check_combinations(resolved(optim={"optimizer": "muon"}).replace(execution={"cuda_graph": True, "dtype": "bf16"}),
                        CUDA, 1)
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
    # Both run Newton-Schulz in bf16, where one batched matmul per shape may round differently from one per matrix
    # (torch 2.11's CPU kernels do): the matrices agree to a sixth of one update's RMS (0.2 lr), the rest exactly.
    matrix_names = names(step.model, hidden_matrices(step.model, list(step.model.parameters()))[0])
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
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if name in matrix_names else 1e-6, msg=name)
    assert all(p.grad is None for p in step.model.parameters())


needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: PyTorch >= 2.9")
SHAPES = [[(48, 16), (16, 16), (16, 40), (48, 16), (16, 40), (16, 16)], [(24, 56), (56, 24), (24, 56)]]


def newton_schulz_float64(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one matrix, in float64 (its own is in bf16)."""
    a, b, c = coefficients
    x = grad.double().T if grad.size(0) > grad.size(1) else grad.double()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def matrices(shapes, seed: int, dtype=torch.float64, device="cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype).to(device)) for s in shapes]


def set_grads(groups, seed: int) -> None:
    """The same fresh gradients on each list of parameters of `groups`."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) for p in groups[0]]
    for params in groups:
        for p, grad in zip(params, grads):
            p.grad = grad.clone()


@needs_torch_muon
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_grouped_muon_equals_torch_muon_with_its_newton_schulz_in_float64(monkeypatch, shapes, nesterov, tensor_lr):
    """Momentum, Nesterov, Newton-Schulz, the AdamW-matched learning rate and the decoupled weight decay, over several
    steps with a changing learning rate: torch.optim.Muon's step, its bf16 orthogonalisation replaced by float64."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_float64)
    want, got = matrices(shapes, 0), matrices(shapes, 0)
    hyper = dict(weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    reference = torch.optim.Muon(want, lr=0.02, **hyper)
    lr = torch.tensor(0.02, dtype=torch.float64) if tensor_lr else 0.02
    grouped = GroupedMuon(got, lr=lr, ns_dtype=torch.float64, **hyper)
    for step, value in enumerate((0.02, 0.05, 0.01, 0.03)):
        reference.param_groups[0]["lr"] = value
        if tensor_lr:
            lr.fill_(value)
        else:
            grouped.param_groups[0]["lr"] = value
        set_grads([want, got], seed=step + 1)
        reference.step()
        grouped.step()
    for p, q in zip(want, got):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-12)
        torch.testing.assert_close(grouped.state[q]["momentum_buffer"], reference.state[p]["momentum_buffer"],
                                   rtol=0, atol=1e-12)


@needs_torch_muon
@pytest.mark.parametrize("shapes", SHAPES)
def test_grouped_muon_in_bf16_equals_torch_muon_on_fp32_weights(shapes):
    """The production path: bf16 Newton-Schulz, as torch.optim.Muon's own, on fp32 weights."""
    want, got = matrices(shapes, 1, torch.float32), matrices(shapes, 1, torch.float32)
    reference = torch.optim.Muon(want, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    grouped = GroupedMuon(got, lr=0.02, weight_decay=0.1)
    for step in range(3):
        set_grads([want, got], seed=step + 7)
        reference.step()
        grouped.step()
    for p, q in zip(want, got):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_stack_is_orthogonalised_as_its_matrices_apart(shapes, dtype):
    """Stacking the matrices of one shape changes nothing: one GroupedMuon over all, against one per matrix, and
    newton_schulz of a stack against the float64 reference of each matrix."""
    together, apart = matrices(shapes, 2, dtype), matrices(shapes, 2, dtype)
    one = GroupedMuon(together, lr=0.03, weight_decay=0.1, ns_dtype=dtype)
    each = [GroupedMuon([p], lr=0.03, weight_decay=0.1, ns_dtype=dtype) for p in apart]
    for step in range(3):
        set_grads([together, apart], seed=step + 3)
        one.step()
        for opt in each:
            opt.step()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for p, q in zip(together, apart):
        torch.testing.assert_close(p, q, rtol=0, atol=tol)
    stack = torch.randn(4, *min(shapes), dtype=dtype)
    stack = stack if stack.size(1) <= stack.size(2) else stack.mT
    want = torch.stack([newton_schulz_float64(m, (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in stack])
    torch.testing.assert_close(newton_schulz(stack, 5, (3.4445, -4.7750, 2.0315), 1e-7).double(), want,
                               rtol=0, atol=tol)


def test_matrices_without_a_gradient_are_left_alone():
    params = matrices([(16, 24), (16, 24), (24, 16)], 4, torch.float32)
    before = [p.detach().clone() for p in params]
    opt = GroupedMuon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert torch.equal(params[1], before[1]) and torch.equal(params[2], before[2])
    assert set(opt.state) == {params[0]}


@needs_torch_muon
def test_a_torch_muon_state_loads_and_steps_the_same():
    """Checkpoints written when the matrices were torch.optim.Muon's resume: the same state, the same next step."""
    want, got = matrices(SHAPES[0], 5, torch.float32), matrices(SHAPES[0], 5, torch.float32)
    reference = torch.optim.Muon(want, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    set_grads([want], seed=1)
    reference.step()
    for p, q in zip(want, got):
        q.data.copy_(p)
    grouped = GroupedMuon(got, lr=0.5, weight_decay=0.0)
    grouped.load_state_dict(copy.deepcopy(reference.state_dict()))  # as from a file: not the same tensors
    assert grouped.param_groups[0]["capturable"] and grouped.param_groups[0]["lr"] == 0.02
    set_grads([want, got], seed=2)
    reference.step()
    grouped.step()
    for p, q in zip(want, got):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_its_step_replays_as_a_cuda_graph_with_the_learning_rate_it_is_given():
    """Captured once with a tensor learning rate, replayed on new gradients and learning rates: the eager steps."""
    device = torch.device("cuda")
    eager, graphed = matrices(SHAPES[0], 6, torch.float32, device), matrices(SHAPES[0], 6, torch.float32, device)
    reference = GroupedMuon(eager, lr=0.02, weight_decay=0.1)
    lr = torch.tensor(0.02, device=device)
    opt = GroupedMuon(graphed, lr=lr, weight_decay=0.1)
    set_grads([eager, graphed], seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first step (the momenta's allocation) eagerly, as GraphedStep's warm-up
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    reference.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step, value in enumerate((0.05, 0.01, 0.03)):
        set_grads([eager], seed=step + 2)
        for p, q in zip(eager, graphed):
            q.grad.copy_(p.grad)
        reference.param_groups[0]["lr"] = value
        lr.fill_(value)
        reference.step()
        graph.replay()
    for p, q in zip(eager, graphed):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_training_step_with_muon_is_captured():
    config = resolved(optim={"optimizer": "muon", "lr": 2e-3}, run={"steps": 10}).replace(
        execution={"cuda_graph": True, "dtype": "bf16", "device": "cuda"})
    torch.manual_seed(0)
    step = build_step(TransformerLM(config.model, config.execution.attn).cuda(), config)
    x, y = (t.cuda() for t in batch())
    losses = [step(x, y)[0].item() for _ in range(6)]
    assert step.graphed.captured and losses[-1] < losses[0], losses


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
