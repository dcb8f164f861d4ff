"""training/optim/registry.py: a new optimizer is one module that registers a builder by name (here, plain SGD defined
in this file); `--optimizer <name>` then trains with it, and what it declares (steps_in_backward, shards,
keeps_weight_copies) decides how the step is built and which configurations resolve() accepts."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import nn

from model import TransformerLM
from model.layers import Linear
from tests.training.resolved import resolved
from training import cli
from training.config import (ConfigError, ExecutionConfig, _check_combinations, _speed_defaults, overlaps_backward,
                             resolve)
from training.optim import OptimizerSettings, get_optimizer, optimizer_names, register, registry
from training.optim.overlapped import OverlappedOptimizer
from training.precision import autocast
from training.step import build_step


# ------------------------------------------------------------------------------------------------ the new optimizer


class SGD(torch.optim.Optimizer):
    """Plain SGD keeping the registry's contract: step(clip_coef=t) scales every gradient by t first, and the weight
    copies it is given are rewritten from the updated weights."""

    def __init__(self, params: list[nn.Parameter], lr: float | torch.Tensor,
                 weight_copies: Optional[dict[nn.Parameter, torch.Tensor]] = None, rewrite_copies: bool = True):
        super().__init__(params, dict(lr=lr))
        own = [p for group in self.param_groups for p in group["params"]]
        copies = weight_copies or {}
        self.weight_copies = {p: copies[p] for p in own if p in copies}
        self.rewrite_copies = rewrite_copies
        self.clip_coefs: list[Optional[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, clip_coef: Optional[torch.Tensor] = None) -> None:
        self.clip_coefs.append(clip_coef)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if clip_coef is None else p.grad * clip_coef
                p.sub_(group["lr"] * grad)
                if self.rewrite_copies and p in self.weight_copies:
                    self.weight_copies[p].copy_(p)


def build_sgd(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> SGD:
    return SGD(params, s.lr, s.weight_copies)


@pytest.fixture
def declare(monkeypatch):
    """declare(name, **declarations): register SGD under `name` for this test only; returns the settings each
    build received."""
    monkeypatch.setattr(registry, "_OPTIMIZERS", dict(registry._OPTIMIZERS))
    settings: list[OptimizerSettings] = []

    def declare_sgd(name: str = "sgd", builder=build_sgd, **declarations) -> list[OptimizerSettings]:
        def build(model, params, s):
            settings.append(s)
            return builder(model, params, s)

        register(name, description="plain SGD", **declarations)(build)
        return settings

    return declare_sgd


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(256, (4, 32), generator=g), torch.randint(256, (4, 32), generator=g)


def step_with(optimizer: str, **sections):
    config = resolved(**{**sections, "optim": {"optimizer": optimizer, "lr": 0.1, **sections.get("optim", {})}})
    torch.manual_seed(0)
    return build_step(TransformerLM(config.model, config.execution.attn), config)


# ------------------------------------------------------------------------------------------------ by name


def test_a_registered_optimizer_trains_a_model_by_name_and_gets_the_clipping_coefficient(declare):
    settings = declare("sgd")
    assert optimizer_names() == ["adamw", "adamw-bf16", "muon", "sgd"]
    spec = get_optimizer("sgd")
    assert spec.description == "plain SGD" and not spec.steps_in_backward and spec.shards
    assert not spec.keeps_weight_copies and spec.capturable and spec.state_layout == "sgd"
    step = step_with("sgd", optim={"grad_clip": 0.5, "lr": 1.0})
    assert isinstance(step.optimizer, SGD)
    (s,) = settings
    assert s.lr == 1.0 and s.config.optimizer == "sgd" and s.device == torch.device("cpu") and not s.capturable
    x, y = batch()
    losses = []
    for _ in range(20):
        loss, norm = step(x, y)
        losses.append(loss.item())
        torch.testing.assert_close(step.optimizer.clip_coefs[-1], torch.clamp(0.5 / (norm + 1e-6), max=1.0))
    assert losses[-1] < losses[0] - 1.0, losses  # the same batch twenty times: it learns it
    assert any(c < 1 for c in step.optimizer.clip_coefs)  # clipping acted
    step.set_lr(0.01)
    assert step.optimizer.param_groups[0]["lr"] == 0.01


def test_a_registered_optimizer_is_a_flag_value(declare):
    declare("sgd")
    config, _ = cli.parse(["--optimizer", "sgd", "--device", "cpu", "--d-model", "64", "--n-heads", "4"])
    assert resolve(config).config.optim.optimizer == "sgd"


def test_unknown_names_are_refused_with_the_known_ones(declare):
    declare("sgd")
    with pytest.raises(KeyError, match="unknown optimizer 'nope'; valid: adamw, adamw-bf16, muon, sgd"):
        get_optimizer("nope")
    with pytest.raises(ConfigError, match=r"^unknown --optimizer 'nope'; valid: adamw, adamw-bf16, muon, sgd$"):
        resolved(optim={"optimizer": "nope"})


# ------------------------------------------------------------------------------------------------ declarations


def test_steps_in_backward_lets_it_step_each_parameter_during_the_backward_as_it_would_after(declare):
    declare("sgd")
    declare("sgd-in-backward", steps_in_backward=True)
    unclipped = {"grad_clip": 0.0}
    assert not overlaps_backward(resolved(optim={"optimizer": "sgd", **unclipped}))
    assert overlaps_backward(resolved(optim={"optimizer": "sgd-in-backward", **unclipped}))
    after, during = step_with("sgd", optim=unclipped), step_with("sgd-in-backward", optim=unclipped)
    assert isinstance(after.optimizer, SGD) and isinstance(during.optimizer, OverlappedOptimizer)
    assert all(isinstance(opt, SGD) for opt in during.optimizer.optimizers)
    assert len(during.optimizer.optimizers) == len(list(during.model.parameters()))  # one per parameter
    for seed in range(3):
        x, y = batch(seed)
        assert torch.equal(after(x, y)[0], during(x, y)[0])
    for p, q in zip(after.model.parameters(), during.model.parameters()):
        assert torch.equal(p, q)
    # Clipped, the same declaration steps after the backward: the coefficient needs every gradient.
    clipped = step_with("sgd-in-backward", optim={"grad_clip": 0.5})
    assert isinstance(clipped.optimizer, SGD)


def test_an_optimizer_that_does_not_shard_is_refused_under_fsdp(declare):
    declare("sgd", shards=False)
    declare("sgd-sharded", shards=True)
    base = resolved()
    fsdp = {"execution": {"parallel": "fsdp"}}
    with pytest.raises(ConfigError, match=r"^--optimizer sgd updates whole parameters; --parallel fsdp shards them: "
                                          r"use --parallel ddp or --optimizer adamw$"):
        resolve(base.replace(optim={"optimizer": "sgd"}, **fsdp), world_size=2)
    sharded = resolve(base.replace(optim={"optimizer": "sgd-sharded"}, **fsdp), world_size=2).config
    assert (sharded.optim.optimizer, sharded.execution.parallel) == ("sgd-sharded", "fsdp")
    ddp = resolve(base.replace(optim={"optimizer": "sgd"}, execution={"parallel": "ddp"}), world_size=2).config
    assert (ddp.optim.optimizer, ddp.execution.parallel) == ("sgd", "ddp")


def test_keeps_weight_copies_gives_it_the_low_precision_weights_the_forward_reads(declare):
    keeping = declare("sgd-copies", keeps_weight_copies=True)
    step = step_with("sgd-copies", execution={"dtype": "bf16"})
    linears = [m for m in step.model.modules() if isinstance(m, Linear)]
    (s,) = keeping
    assert len(s.weight_copies) == len(linears) > 0
    assert all(m.weight_copy is not None and s.weight_copies[m.weight] is m.weight_copy for m in linears)
    step(*batch())
    for m in linears:  # rewritten by the optimizer from the updated weights
        assert torch.equal(m.weight_copy, m.weight.detach().bfloat16())

    plain = declare("sgd-plain")
    step = step_with("sgd-plain", execution={"dtype": "bf16"})
    assert plain[-1].weight_copies is None
    assert all(m.weight_copy is None for m in step.model.modules() if isinstance(m, Linear))


def test_the_forward_reads_the_copies_so_an_optimizer_keeping_them_must_rewrite_them(declare):
    declare("sgd-copies", keeps_weight_copies=True)
    declare("sgd-stale", builder=lambda model, params, s: SGD(params, s.lr, s.weight_copies, rewrite_copies=False),
            keeps_weight_copies=True)
    x, y = batch()
    for name, rewrites in (("sgd-copies", True), ("sgd-stale", False)):
        step = step_with(name, execution={"dtype": "bf16"})
        step(x, y)
        loss = step.loss(x, y).detach()
        # The same weights without copies: each forward casts them afresh.
        reference = TransformerLM(step.config.model, step.config.execution.attn)
        reference.load_state_dict(step.model.state_dict())
        with autocast(torch.device("cpu"), "bf16"):
            want = reference(x, y).detach()
        if rewrites:
            assert torch.equal(loss, want)
        else:
            assert abs(loss.item() - want.item()) > 1e-3  # the forward read the stale copies


def test_an_optimizer_that_cannot_be_captured_keeps_the_cuda_graph_off_and_refuses_it(declare):
    """capturable=False: the graph is left off by default, with the reason among the run's first words, and an
    explicit --cuda-graph is refused in one line (checked as on a GPU: the rules need no device)."""
    declare("sgd-host", capturable=False)
    declare("sgd-graphed")
    cuda = torch.device("cuda")
    ex, choices = _speed_defaults(ExecutionConfig(), cuda, "sgd-host")
    assert not ex.cuda_graph
    assert choices[-1] == "no CUDA graph (not captured with --optimizer sgd-host, whose step reads its learning rate " \
                          "on the host)"
    assert _speed_defaults(ExecutionConfig(), cuda, "sgd-graphed")[0].cuda_graph
    asked = resolved().replace(optim={"optimizer": "sgd-host"}, execution={"cuda_graph": True, "dtype": "bf16"})
    with pytest.raises(ConfigError) as e:
        _check_combinations(asked, cuda, 1)
    assert str(e.value) == ("--cuda-graph: not captured with --optimizer sgd-host, whose step reads its learning rate "
                            "on the host")
    _check_combinations(asked.replace(optim={"optimizer": "sgd-graphed"}), cuda, 1)


def test_the_state_layout_says_which_checkpoints_an_optimizer_continues_from(declare):
    declare("sgd")
    declare("sgd-like-adamw", state_layout="adamw")
    assert [registry.state_layout(n) for n in ("adamw", "adamw-bf16", "muon", "sgd", "sgd-like-adamw", "gone")] == [
        "adamw", "adamw", "muon", "sgd", "adamw", "gone"]
