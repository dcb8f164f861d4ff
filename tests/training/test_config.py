"""training/config.py: resolve() fills the automatic defaults (device, dtype, compile, CUDA graph, warm-up), checks
every rule with a one-line ConfigError naming the flags, and warns of settings that are legal but probably not meant;
overlaps_backward says when the optimizer steps during the backward; backend_problem checks a backend without a
model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import train
from model import ModelConfig
from training import cli
from training.config import (Config, ConfigError, ExecutionConfig, OptimConfig, _speed_defaults, as_flags,
                             backend_problem, flag_of, graph_obstacle, overlaps_backward, resolve,
                             world_size_from_env)
from training.optim import registry
from training.optim.registry import OptimizerSpec

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256, context_length=128)
BASE = Config(model=SMALL).replace(execution={"device": "cpu"}, data={"batch_size": 8}, run={"steps": 2000})


def config(**sections) -> Config:
    return BASE.replace(**sections)


# ------------------------------------------------------------------------------------------------ defaults


def test_the_cpu_defaults_to_fp32_eager_without_a_graph_and_says_so():
    r = resolve(config())
    ex = r.config.execution
    assert (ex.dtype, ex.compile, ex.cuda_graph, ex.device) == ("fp32", False, False, "cpu")
    assert r.choices == ["fp32 throughout", "eager (--compile compiles, which pays on GPUs)",
                         "no CUDA graph (CUDA graphs need a GPU)"]
    assert r.warnings == []
    # Every other field as given.
    assert dataclasses.replace(ex, dtype=None, compile=None, cuda_graph=None) == BASE.execution
    assert (r.config.model, r.config.data, r.config.run) == (BASE.model, BASE.data, BASE.run)


def test_the_device_defaults_to_cuda_when_there_is_a_gpu(monkeypatch):
    default = Config(model=SMALL)
    assert resolve(default).config.execution.device == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(default).config.execution.device == "cpu"


@pytest.mark.parametrize("steps, warmup", [(2000, 100), (1000, 100), (500, 50), (15, 1), (5, 0)])
def test_the_warm_up_defaults_to_100_steps_at_most_a_tenth_of_the_run(steps, warmup):
    assert resolve(config(run={"steps": steps})).config.optim.warmup_steps == warmup
    assert resolve(config(run={"steps": steps}, optim={"warmup_steps": 7})).config.optim.warmup_steps == 7


def test_cuda_defaults_to_bf16_compiled_and_graphed():
    ex, choices = _speed_defaults(ExecutionConfig(), CUDA)
    assert (ex.dtype, ex.compile, ex.cuda_graph, ex.device) == ("bf16", torch._dynamo.is_dynamo_supported(), True,
                                                                "cuda")
    assert choices[0] == "bf16 autocast over fp32 weights" and choices[-1] == "each step replayed as one CUDA graph"


@pytest.mark.parametrize("setting, reason", [
    (dict(parallel="ddp"), "not captured under --parallel ddp"),
    (dict(parallel="fsdp"), "not captured under --parallel fsdp"),
    (dict(dtype="fp16"), "not captured with fp16, whose gradient scaler checks for inf on the host"),
    (dict(activation_checkpointing=True), "not captured with --activation-checkpointing"),
])
def test_the_graph_stays_off_where_it_does_not_apply_and_says_why(setting, reason):
    ex, choices = _speed_defaults(ExecutionConfig(**setting), CUDA)
    assert not ex.cuda_graph and f"no CUDA graph ({reason})" in choices
    assert ex.compile == torch._dynamo.is_dynamo_supported()  # compiling still applies
    assert graph_obstacle(CUDA, ex.parallel, ex.dtype, ex.activation_checkpointing, "adamw") == reason
    assert graph_obstacle(CPU, "none", "fp32", False, "adamw") == "CUDA graphs need a GPU"
    assert graph_obstacle(CUDA, "none", "bf16", False, "adamw") is None


def test_given_settings_win():
    ex, choices = _speed_defaults(ExecutionConfig(dtype="fp32", compile=False, cuda_graph=False), CUDA)
    assert (ex.dtype, ex.compile, ex.cuda_graph) == ("fp32", False, False)
    assert choices == ["fp32 throughout", "eager"]
    forced, _ = _speed_defaults(ExecutionConfig(dtype="bf16", compile=True), CPU)
    assert (forced.dtype, forced.compile, forced.cuda_graph) == ("bf16", True, False)


def test_train_py_fills_in_the_defaults_and_keeps_the_opt_outs():
    def execution(*argv):
        r = train.parse(["--device", "cpu", *argv])
        return r.config.execution, train.first_line(r)

    ex, line = execution()
    assert (ex.dtype, ex.compile, ex.cuda_graph) == ("fp32", False, False)
    assert "on cpu: fp32 throughout; eager" in line
    ex, _ = execution("--compile", "--dtype", "bf16")
    assert (ex.dtype, ex.compile, ex.cuda_graph) == ("bf16", True, False)
    ex, _ = execution("--no-compile", "--no-cuda-graph")
    assert (ex.compile, ex.cuda_graph) == (False, False)


def test_a_cuda_graph_asked_for_on_the_cpu_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as exit:
        train.parse(["--device", "cpu", "--cuda-graph"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == "error: --cuda-graph: CUDA graphs need a GPU\n"


# ------------------------------------------------------------------------------------------------ the rules


@pytest.mark.parametrize("sections, message", [
    (dict(run={"eval_every": -1}), "--eval-every must be >= 0, got -1"),
    (dict(run={"ckpt_every": -3}), "--ckpt-every must be >= 0, got -3"),
    (dict(run={"keep_checkpoints": -1}), "--keep-checkpoints must be >= 0, got -1"),
    (dict(run={"steps": 0}), "--steps must be >= 1, got 0"),
    (dict(run={"log_every": 0}), "--log-every must be >= 1, got 0"),
    (dict(optim={"grad_clip": -1.0}), "--grad-clip must be >= 0, got -1"),
    (dict(optim={"warmup_steps": -5}), "--warmup-steps must be >= 0, got -5"),
    (dict(optim={"lr": -0.1}), "--lr must be >= 0, got -0.1"),
    (dict(optim={"embed_lr_scale": 0.0}), "--embed-lr-scale must be > 0, got 0"),
    (dict(data={"batch_size": 0}), "--batch-size must be >= 1, got 0"),
    (dict(data={"vocab_size": 0}), "--vocab-size must be >= 1, got 0"),
    (dict(execution={"dist_timeout": 0.0}), "--dist-timeout must be > 0 seconds, got 0"),
    (dict(optim={"lr": 1e-4, "min_lr": 1e-3}), "--min-lr (0.001) is larger than --lr (0.0001)"),
    (dict(run={"resume": True, "overwrite": True}), "--resume continues the run in --out and --overwrite moves it "
                                                    "aside: pass one of them"),
    (dict(execution={"dtype": "fp64"}), "--dtype: unknown value 'fp64'; valid: fp32, bf16, fp16"),
    (dict(execution={"parallel": "tp"}), "--parallel: unknown value 'tp'; valid: none, ddp, fsdp"),
    (dict(execution={"fp8": "blockwise"}), "--fp8: unknown value 'blockwise'; valid: off, tensorwise, rowwise"),
    (dict(run={"wandb": "cloud"}), "--wandb: unknown value 'cloud'; valid: offline, online, disabled"),
    (dict(execution={"attn": "nope"}), "unknown --attn 'nope'; valid: naive, compiled, sdpa"),
    (dict(optim={"optimizer": "lion"}), "unknown --optimizer 'lion'; valid: adamw, adamw-bf16"),
    (dict(execution={"dtype": "fp16"}), "--dtype fp16 needs a CUDA device (the gradient scaler is CUDA-only); use "
                                        "bf16 or fp32"),
    (dict(execution={"cuda_graph": True}), "--cuda-graph: CUDA graphs need a GPU"),
    (dict(execution={"device": "gpu0"}), "--device: "),
    (dict(execution={"grad_accum_steps": 3}), "--grad-accum-steps 3 must divide the sequences per rank and step (8)"),
    (dict(execution={"recompute": "selective"}), "--recompute selective says what --activation-checkpointing "
                                                 "recomputes: add --activation-checkpointing"),
    (dict(execution={"recompute": "some"}), "--recompute: unknown value 'some'; valid: full, selective"),
])
def test_each_rule_names_its_flags(sections, message):
    with pytest.raises(ConfigError) as e:
        resolve(config(**sections))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("sections, world_size, message", [
    (dict(execution={"parallel": "fsdp"}, optim={"optimizer": "muon"}), 2,
     "--optimizer muon updates whole parameters; --parallel fsdp shards them: use --parallel ddp or "
     "--optimizer adamw"),
    (dict(execution={"parallel": "fsdp", "dtype": "fp16"}), 2,
     "--parallel fsdp supports --dtype bf16 or fp32 (fp16 would need a sharded gradient scaler)"),
    (dict(execution={"parallel": "ddp"}), 3,
     "--batch-size 8 (the global batch) is not divisible by the 3 ranks; pass a multiple of 3"),
    (dict(execution={"parallel": "ddp", "grad_accum_steps": 3}), 2,
     "--grad-accum-steps 3 must divide the sequences per rank and step (4)"),
])
def test_the_ranks_rules_name_their_flags(sections, world_size, message):
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        resolve(config(**sections), world_size=world_size)


def test_the_ranks_are_torchruns_under_parallel(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert world_size_from_env("ddp") == 3 and world_size_from_env("none") == 1
    with pytest.raises(ConfigError, match="not divisible by the 3 ranks"):
        resolve(config(execution={"parallel": "ddp"}))
    assert resolve(config()).config.data.batch_size == 8  # one process: WORLD_SIZE is not read
    assert resolve(config(execution={"parallel": "ddp"}, data={"batch_size": 9})).config.execution.parallel == "ddp"


def test_a_cuda_device_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device cuda asked for, but no CUDA GPU is visible; use --device cpu$"):
        resolve(config(execution={"device": "cuda"}))
    with pytest.raises(ConfigError, match=r"use --device cpu \(the ranks then talk over gloo\)$"):
        resolve(config(execution={"device": "cuda", "parallel": "ddp"}), world_size=2)


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "64", "--n-heads", "4", "--n-kv-heads", "3"], "--n-kv-heads must divide --n-heads (4), got 3"),
    (["--d-model", "30", "--n-heads", "4"], "--d-model (30) must be divisible by --n-heads (4)"),
    (["--d-model", "96", "--n-heads", "32"], "RoPE needs an even d_head, got --d-model/--n-heads = 3"),
    (["--window-pattern", "LLG"], "--window-pattern LLG needs --window"),
    (["--n-layers", "0"], "--n-layers must be >= 1, got 0"),
    (["--attn-softcap", "-1"], "--attn-softcap must be > 0, got -1.0"),
])
def test_the_models_rules_are_spelled_as_flags(argv, message):
    """The model's own rules (ModelConfig.problem, in field names) reach the command line in flag names."""
    parsed, _ = cli.parse(argv)
    with pytest.raises(ConfigError) as e:
        resolve(parsed.replace(execution={"device": "cpu"}))
    assert str(e.value).startswith(message)


def test_field_names_become_flags():
    assert as_flags("n_kv_heads must divide n_heads (4)") == "--n-kv-heads must divide --n-heads (4)"
    assert as_flags("window_pattern G needs window") == "--window-pattern G needs --window"
    assert as_flags("--lr stays, d_head is no field") == "--lr stays, d_head is no field"
    assert flag_of("execution", "cuda_graph") == "--cuda-graph" and flag_of("run", "keep_checkpoints") == \
        "--keep-checkpoints"


def test_the_attention_backend_is_checked_against_the_model_and_the_device():
    with pytest.raises(ConfigError, match=r"^--attn flex cannot run on cpu with float32 for training: FlexAttention "
                                          r"has no backward on the CPU"):
        resolve(config(execution={"attn": "flex"}))
    if not torch.cuda.is_available():
        assert resolve(config(execution={"attn": "flex"}), training=False).config.execution.attn == "flex"
    capped = config(model={"attn_softcap": 30.0})
    with pytest.raises(ConfigError, match="--attn sdpa cannot run .* logit soft-capping; backends that can: naive"):
        resolve(capped)
    assert resolve(capped.replace(execution={"attn": "naive"})).config.model.attn_softcap == 30.0


# ------------------------------------------------------------------------------------------------ warnings


def test_a_warm_up_not_shorter_than_the_run_is_said_when_asked_for():
    long = config(optim={"warmup_steps": 3000})
    assert resolve(config(), frozenset({"warmup_steps"})).warnings == []
    assert resolve(long).warnings == []  # not the user's choice
    assert resolve(long, frozenset({"warmup_steps"})).warnings == [
        "warning: --warmup-steps 3000 is not shorter than the run (--steps 2000): the learning rate never reaches "
        "--lr 0.0006"]


def test_a_window_that_changes_no_layer_is_said():
    window = dataclasses.replace(SMALL, window=64, window_pattern="LLLG")
    assert resolve(config(model=dataclasses.asdict(window))).warnings == []
    assert resolve(config(model={**dataclasses.asdict(window), "window_pattern": "G"})).warnings == [
        "warning: --window-pattern G has no local layer (L): --window 64 changes no layer"]
    assert resolve(config(model={**dataclasses.asdict(window), "window": 128})).warnings == [
        "warning: --window 128 is not shorter than --context-length 128: the local layers see their whole context"]


def test_profile_steps_without_a_profile_directory_is_said(tmp_path):
    asked = config(run={"profile_steps": 5})
    assert resolve(asked, frozenset({"profile_steps"})).warnings == [
        "warning: --profile-steps 5 records nothing without --profile DIR"]
    assert resolve(config(run={"profile_steps": 5, "profile": str(tmp_path)}), frozenset({"profile_steps"})
                   ).warnings == []


# ------------------------------------------------------------------------------------------------ overlap


@pytest.fixture
def no_backward_steps(monkeypatch):
    """An optimizer that cannot step each parameter on its own, registered for one test."""
    spec = OptimizerSpec("whole-step", registry.get_optimizer("adamw").build, "steps all parameters at once")
    monkeypatch.setitem(registry._OPTIMIZERS, spec.name, spec)
    return spec.name


@pytest.mark.parametrize("change, world_size, overlapped", [
    ({}, 1, True),
    (dict(execution={"dtype": "bf16"}), 1, True),
    (dict(execution={"dtype": "fp32"}), 1, True),
    (dict(optim={"optimizer": "adamw-bf16"}), 1, True),
    (dict(optim={"grad_clip": 1.0}), 1, False),  # clipping needs every gradient first
    ({}, 2, False),  # DDP and FSDP reduce the gradients after the hooks
    (dict(execution={"parallel": "ddp"}), 1, False),
    (dict(execution={"grad_accum_steps": 2}), 1, False),  # the gradients of several backward passes
    (dict(execution={"dtype": "fp16"}), 1, False),  # the loss scale is unscaled after the backward
    (dict(optim={"optimizer": "whole-step"}), 1, False),
], ids=["unclipped", "bf16", "fp32", "adamw-bf16", "clipped", "two-ranks", "ddp", "accumulation", "fp16",
        "optimizer-cannot"])
def test_the_optimizer_steps_during_the_backward_exactly_when_nothing_needs_all_gradients(
        no_backward_steps, change, world_size, overlapped):
    unclipped = Config().replace(optim={"grad_clip": 0.0})
    assert overlaps_backward(unclipped.replace(**change), world_size) is overlapped


def test_resolve_says_when_the_optimizer_steps_during_the_backward():
    assert "adamw stepped during the backward (no clipping)" in resolve(config(optim={"grad_clip": 0.0})).choices
    assert not any("backward" in c for c in resolve(config()).choices)


# ------------------------------------------------------------------------------------------------ the tree


def test_replace_keeps_the_other_fields_and_the_tree_is_frozen():
    c = Config().replace(run={"steps": 10}, execution={"attn": "flash"})
    assert (c.run.steps, c.execution.attn) == (10, "flash")
    assert c.replace(run={"steps": 1000}, execution={"attn": "sdpa"}) == Config()
    assert c.optim == OptimConfig() and c.run.out == Config().run.out
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.run.steps = 3
    assert set(c.to_dict()) == {"model", "execution", "optim", "data", "run"}
    assert c.to_dict()["run"]["steps"] == 10 and c.to_dict()["model"] == Config().model.to_dict()


# ------------------------------------------------------------------------------------------------ backends

# Why SDPA pinned to its flash kernel cannot take CPU tensors: without a GPU, the machine lacks one; with one, the
# tensors are on the wrong device.
SDPA_FLASH_ON_CPU = {False: "needs a CUDA GPU", True: "needs CUDA tensors, got cpu"}


@pytest.mark.parametrize("gpu", sorted({torch.cuda.is_available(), True}), ids=lambda gpu: f"gpu={gpu}")
def test_backends_are_checked_against_the_device_without_a_model(monkeypatch, gpu):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)  # True: as on a GPU machine (a no-op on one)
    assert backend_problem("sdpa", "cpu", torch.float32, d_head=16) is None
    message = backend_problem("sdpa-flash", "cpu", torch.float32, d_head=16)
    assert message.startswith(f"--attn sdpa-flash cannot run on cpu with float32 for training: "
                              f"{SDPA_FLASH_ON_CPU[gpu]}; backends that can: naive, compiled, sdpa")
    assert "sdpa-flash" not in message.split("backends that can:")[1]
    if not torch.cuda.is_available():
        flex = backend_problem("flex", "cpu", torch.float32, d_head=16)
        assert "FlexAttention has no backward on the CPU" in flex
        assert backend_problem("flex", "cpu", torch.float32, d_head=16, training=False) is None


def test_the_models_attention_variants_are_checked_too():
    message = backend_problem("sdpa", "cpu", torch.float32, d_head=16, kv_groups=2, window=8, softcap=50.0)
    assert message.startswith("--attn sdpa cannot run on cpu with float32 for training: it does not support logit "
                              "soft-capping")
    assert "backends that can: naive, compiled" in message and ", sdpa" not in message.split("can:")[1]
    assert backend_problem("sdpa", "cpu", torch.float32, d_head=16, kv_groups=2, window=8, documents=True) is None
    pinned = backend_problem("sdpa-flash", "cpu", torch.float32, d_head=16, documents=True)
    assert pinned is not None and "backends that can: naive, compiled, sdpa" in pinned
