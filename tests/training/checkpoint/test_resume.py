"""training/checkpoint/resume.py: what a checkpoint holds, what it must match to resume, and what may change."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.checkpoints import legacy_rng_state
from training.checkpoint import files as checkpoint_files
from training.checkpoint import format as checkpoint
from training.checkpoint.files import CheckpointError
from training.checkpoint.inference import run_config_of
from training.checkpoint.resume import (ResumeError, Resumed, check_architecture, execution_changes, load_checkpoint,
                                        optimizers_of, save_checkpoint)
from training.config import Config, resolve
from training.optim.overlapped import OverlappedOptimizer
from training.parallel.distributed import DistContext
from training.step import TrainingStep, build_step

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=64, context_length=16)
CONFIG = Config(model=CFG).replace(execution={"attn": "naive", "dtype": "fp32"}, run={"steps": 10})


def no_warning(message: str) -> None:
    pytest.fail(f"unexpected warning: {message}")


def resolved(**optim) -> Config:
    return resolve(CONFIG.replace(optim=optim)).config


def trained(config: Config, seed: int, steps: int = 2) -> tuple[TransformerLM, TrainingStep]:
    """A model of `seed` and its step, after `steps` steps on fixed batches (so that the optimizer has state)."""
    torch.manual_seed(seed)
    model = TransformerLM(config.model, config.execution.attn)
    step = build_step(model, config)
    gen = torch.Generator().manual_seed(100)
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1), generator=gen)
        step(ids[:, :-1], ids[:, 1:])
    return model, step


def optimizer_state_by_name(model: torch.nn.Module, optimizer) -> dict[str, dict]:
    """Each parameter's optimizer state and its group's hyperparameters, by parameter name, from one optimizer or
    from one per parameter alike."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for opt in optimizers_of(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                found[names[id(p)]] = {"lr": float(group["lr"]), "weight_decay": group["weight_decay"],
                                       **opt.state.get(p, {})}
    return found


def assert_same_optimizer_state(model_a, optimizer_a, model_b, optimizer_b) -> None:
    a, b = optimizer_state_by_name(model_a, optimizer_a), optimizer_state_by_name(model_b, optimizer_b)
    assert a.keys() == b.keys() == {n for n, _ in model_a.named_parameters()}
    for name in a:
        assert a[name].keys() == b[name].keys() and {"exp_avg", "exp_avg_sq", "step"} <= a[name].keys(), name
        for key, value in a[name].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(b[name][key], value), (name, key)
            else:
                assert b[name][key] == value, (name, key)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def saved_run(out: Path, config: Config, scaler: torch.amp.GradScaler) -> None:
    out.mkdir()
    model = TransformerLM(config.model, config.execution.attn)
    save_checkpoint(out, model, torch.optim.AdamW(model.parameters()), scaler, 3, config)


def resume(out: Path, config: Config, scaler: torch.amp.GradScaler) -> Resumed:
    model = TransformerLM(config.model, config.execution.attn)
    return load_checkpoint(out, model, torch.optim.AdamW(model.parameters()), scaler, config, DistContext(),
                           warn=no_warning)


def test_save_then_load_restores_model_optimizer_scaler_rng_and_step(tmp_path):
    config = resolved()
    a, step_a = trained(config, seed=0)
    path = save_checkpoint(tmp_path, a, step_a.optimizer, torch.amp.GradScaler("cpu", init_scale=2.0 ** 7), 7, config,
                           extra={"clock_s": 1.5, "points": [{"step": 7}]})
    assert path == tmp_path / "checkpoint-7.safetensors"
    after_save = (torch.rand(4), np.random.rand(2), random.random())  # the RNGs come back to the moment of saving

    state = checkpoint_files.load_file(path)
    assert state["step"] == 7 and state["config"] == config.to_dict()
    assert "model_config" not in state and "args" not in state
    assert set(state["optimizer"]["state"]) == {n for n, _ in a.named_parameters()}, "keyed by parameter name"

    b, step_b = trained(config, seed=1, steps=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 3)
    assert load_checkpoint(tmp_path, b, step_b.optimizer, scaler, config, DistContext(), no_warning) == Resumed(
        7, path, [], {"clock_s": 1.5, "points": [{"step": 7}]})
    assert torch.equal(torch.rand(4), after_save[0]) and np.array_equal(np.random.rand(2), after_save[1])
    assert random.random() == after_save[2]
    assert scaler.get_scale() == 2.0 ** 7
    assert_same_weights(a, b)
    assert_same_optimizer_state(a, step_a.optimizer, b, step_b.optimizer)
    # And so the next step is the same too.
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1))
    for step in (step_a, step_b):
        step(ids[:, :-1], ids[:, 1:])
    assert_same_weights(a, b)


@pytest.mark.parametrize("written, read", [(0.0, 1.0), (1.0, 0.0)], ids=["overlapped-to-plain", "plain-to-overlapped"])
def test_optimizer_state_moves_between_one_optimizer_and_one_per_parameter(tmp_path, written, read):
    """--grad-clip 0 steps each parameter with an optimizer of its own during the backward: its checkpoint resumes a
    run with clipping (one optimizer), and the other way round, with the same state for every parameter."""
    config_w, config_r = resolved(grad_clip=written), resolved(grad_clip=read)
    a, step_a = trained(config_w, seed=0)
    assert isinstance(step_a.optimizer, OverlappedOptimizer) == (written == 0)
    save_checkpoint(tmp_path, a, step_a.optimizer, step_a.scaler, 2, config_w)
    b, step_b = trained(config_r, seed=1, steps=0)
    assert isinstance(step_b.optimizer, OverlappedOptimizer) == (read == 0)
    resumed = load_checkpoint(tmp_path, b, step_b.optimizer, step_b.scaler, config_r, DistContext(), no_warning)
    assert resumed.step == 2 and resumed.changes == []
    assert_same_weights(a, b)
    assert_same_optimizer_state(a, step_a.optimizer, b, step_b.optimizer)


@pytest.mark.parametrize("written, read", [(10.0, 1.0), (1.0, 10.0)])
def test_a_resumed_run_steps_with_its_own_settings_and_the_checkpoints_state(tmp_path, written, read):
    """--embed-lr-scale and --weight-decay may change on resume, and a graphed run's tensor learning rate comes back as
    this run's kind: every group keeps the settings this run built it with (loading by name would hand each group those
    of the saved group that held its first parameter), and every parameter the checkpoint's moments and step count."""
    config_w, config_r = resolved(embed_lr_scale=written), resolved(embed_lr_scale=read, weight_decay=0.05)
    a, step_a = trained(config_w, seed=0)
    for group in step_a.optimizer.param_groups:  # as a CUDA-graphed run holds it
        group["lr"] = torch.tensor(float(group["lr"]))
    save_checkpoint(tmp_path, a, step_a.optimizer, step_a.scaler, 2, config_w)
    b, step_b = trained(config_r, seed=1, steps=0)
    built = [{k: v for k, v in group.items() if k != "params"} for group in step_b.optimizer.param_groups]
    load_checkpoint(tmp_path, b, step_b.optimizer, step_b.scaler, config_r, DistContext(), no_warning)
    assert [{k: v for k, v in group.items() if k != "params"} for group in step_b.optimizer.param_groups] == built
    step_b.set_lr(1e-3)
    saved, loaded = optimizer_state_by_name(a, step_a.optimizer), optimizer_state_by_name(b, step_b.optimizer)
    for name, state in loaded.items():
        embedding = name == "embed.weight"
        assert type(state["lr"]) is float and state["lr"] == pytest.approx(1e-3 * (read if embedding else 1))
        assert state["weight_decay"] == (0.05 / read if embedding else 0.05 if b.get_parameter(name).dim() > 1 else 0)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], saved[name][key]), (name, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphed"])
def test_a_cpu_runs_checkpoint_resumes_on_the_gpu_with_its_step_counts_there(tmp_path, graph):
    """A CPU run's AdamW is neither fused nor capturable and keeps its step counts on the CPU; the GPU run it resumes
    into is fused (and capturable when graphed): every count moves to the GPU, and the run goes on as the CPU run does."""
    cpu = resolve(CONFIG.replace(execution={"device": "cpu"})).config
    a, step_a = trained(cpu, seed=0)
    save_checkpoint(tmp_path, a, step_a.optimizer, step_a.scaler, 2, cpu)
    gpu = resolve(CONFIG.replace(execution={"device": "cuda", "compile": False, "cuda_graph": graph})).config
    torch.manual_seed(1)
    b = TransformerLM(gpu.model, gpu.execution.attn).cuda()
    step_b = build_step(b, gpu)
    load_checkpoint(tmp_path, b, step_b.optimizer, step_b.scaler, gpu, DistContext(device=torch.device("cuda")),
                    no_warning)
    counts = [state["step"] for opt in optimizers_of(step_b.optimizer) for state in opt.state.values()]
    assert counts and all(t.is_cuda and t.dtype == torch.float32 and t.item() == 2 for t in counts)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):  # graphed: two eager steps, the capture, a replay
        ids = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1), generator=gen)
        loss_a, _ = step_a(ids[:, :-1], ids[:, 1:])
        loss_b, _ = step_b(ids[:, :-1].cuda(), ids[:, 1:].cuda())
        torch.testing.assert_close(loss_b.cpu(), loss_a, rtol=1e-3, atol=1e-4)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-3, atol=1e-4)


def test_a_scaler_that_was_off_starts_anew_and_one_that_was_on_keeps_its_scale(tmp_path):
    fp16 = CONFIG.replace(execution={"dtype": "fp16"})
    saved_run(tmp_path / "off", CONFIG, torch.amp.GradScaler("cpu", enabled=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    resumed = resume(tmp_path / "off", fp16, scaler)
    assert resumed.step == 3 and scaler.get_scale() == 2.0 ** 10
    assert resumed.changes == ["resuming with --dtype fp16; the checkpoint was written with fp32 (the weights do not "
                               "depend on it)"]
    saved_run(tmp_path / "on", CONFIG, torch.amp.GradScaler("cpu", init_scale=2.0 ** 5))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    resume(tmp_path / "on", fp16, scaler)
    assert scaler.get_scale() == 2.0 ** 5


def test_a_checkpoint_older_than_a_config_field_had_its_default(tmp_path):
    """A field missing from the saved config was the default then: asking for another value is another model."""
    out = tmp_path / "old"
    saved_run(out, CONFIG, torch.amp.GradScaler("cpu", enabled=False))
    path = checkpoint_files.candidates(out)[0]
    state = checkpoint_files.load_file(path)
    del state["config"]["model"]["window"]
    checkpoint.save(state, path)
    resume(out, CONFIG, torch.amp.GradScaler("cpu", enabled=False))  # the default: the same model
    with pytest.raises(ResumeError, match=rf"^checkpoint {path} was written for another model: --window None "
                                          r"\(asked 8\)$"):
        resume(out, CONFIG.replace(model={"window": 8}), torch.amp.GradScaler("cpu", enabled=False))


def test_another_model_is_refused_naming_its_flags(tmp_path):
    path = tmp_path / "checkpoint-3.safetensors"
    state = {"config": CONFIG.to_dict()}
    check_architecture(path, state, CFG)
    check_architecture(path, {"model_config": {**CFG.to_dict(), "attn": "flash"}}, CFG)  # an earlier version's
    with pytest.raises(ResumeError) as e:
        check_architecture(path, state, replace(CFG, d_model=64, n_kv_heads=2))
    assert str(e.value) == (f"checkpoint {path} was written for another model: --d-model 32 (asked 64), "
                            "--n-kv-heads None (asked 2)")
    # Through a resume: refused before any weight is touched.
    out = tmp_path / "run"
    saved_run(out, CONFIG, torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ResumeError, match=r"another model: --n-layers 2 \(asked 3\)$"):
        resume(out, CONFIG.replace(model={"n_layers": 3}), torch.amp.GradScaler("cpu", enabled=False))


def test_execution_changes_name_what_runs_differently():
    state = {"config": CONFIG.to_dict()}
    assert execution_changes(state, CONFIG) == []
    assert execution_changes(state, CONFIG.replace(execution={"attn": "sdpa"})) == [
        "resuming with --attn sdpa; the checkpoint was written with naive (the weights do not depend on it)"]
    assert execution_changes(state, CONFIG.replace(execution={"attn": "sdpa", "activation_checkpointing": True})) == [
        "resuming with --attn sdpa; the checkpoint was written with naive (the weights do not depend on it)",
        "resuming with --activation-checkpointing True; the checkpoint was written with False (the weights do not "
        "depend on it)"]
    assert execution_changes(state, CONFIG.replace(execution={"device": "cuda:1"})) == [], "where, not how it runs"
    # Other sections are not execution: a changed optimizer setting is not listed here.
    assert execution_changes(state, CONFIG.replace(optim={"lr": 1e-3}, run={"steps": 20})) == []
    # An earlier version's checkpoint records no execution section: nothing to compare.
    assert execution_changes({"model_config": CFG.to_dict(), "args": {"attn": "flash"}}, CONFIG) == []


def old_checkpoint(out: Path, model: torch.nn.Module, optimizer, step: int) -> Path:
    """A checkpoint as an earlier version wrote it, torch.save's pickle as `checkpoint-<step>.pt`: the optimizer's own
    state dict (keyed by index; one per parameter under the former --overlap-optimizer), the model config with the
    switches since retired, the flags as "args", and the RNG states as pickled objects (NumPy's among them)."""
    model_config = {**CFG.to_dict(), "attn": "naive", "fp32_weight_grads": True, "fused_rope": False,
                    "fp32_residual": False, "fused_gate_up": True}
    args = {"data": "corpus.txt", "batch_size": 8, "seed": 3, "eval_batches": 4, "dtype": "fp32", "steps": 100,
            "compile_scope": "blocks", "overlap_optimizer": False, "no_checkpoint": False}
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {}, "step": step,
             "rng": legacy_rng_state(), "model_config": model_config, "args": args}
    for opt in optimizers_of(optimizer):
        assert all(isinstance(k, int) for k in opt.state_dict()["state"])
    path = out / f"checkpoint-{step}.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("written, read", [(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 1.0)],
                         ids=["plain-to-plain", "plain-to-overlapped", "overlapped-to-overlapped",
                              "overlapped-to-plain"])
def test_an_old_format_checkpoint_still_resumes(tmp_path, written, read):
    """An earlier version's run with --grad-clip 0 had one optimizer (unless --overlap-optimizer): resumed with
    --grad-clip 0 now, its parameters step in the backward, each with an optimizer of its own."""
    a, step_a = trained(resolved(grad_clip=written), seed=0)
    assert isinstance(step_a.optimizer, OverlappedOptimizer) == (written == 0)
    path = old_checkpoint(tmp_path, a, step_a.optimizer, 5)
    after_save = np.random.rand(2)
    config = resolved(grad_clip=read)
    b, step_b = trained(config, seed=1, steps=0)
    with pytest.raises(CheckpointError, match=rf"^no checkpoint in {tmp_path} loads: checkpoint-5.pt \(written by an "
                                              r"earlier version with pickle, .* pass --allow-pickle if you trust this "
                                              r"file\)$"):
        load_checkpoint(tmp_path, b, step_b.optimizer, step_b.scaler, config, DistContext(), no_warning)
    config = config.replace(run={"allow_pickle": True})
    resumed = load_checkpoint(tmp_path, b, step_b.optimizer, step_b.scaler, config, DistContext(), no_warning)
    assert resumed == Resumed(5, path, [], {})
    assert np.array_equal(np.random.rand(2), after_save), "its NumPy RNG state restored"
    assert_same_weights(a, b)
    assert_same_optimizer_state(a, step_a.optimizer, b, step_b.optimizer)


def test_run_config_of_an_old_format_checkpoint(tmp_path):
    a, step_a = trained(resolved(), seed=0, steps=1)
    state = checkpoint_files.load_file(old_checkpoint(tmp_path, a, step_a.optimizer, 5), allow_pickle=True)
    assert run_config_of(state) == Config(model=CFG).replace(
        execution={"attn": "naive", "dtype": "fp32"}, data={"data": "corpus.txt", "batch_size": 8},
        run={"seed": 3, "eval_batches": 4})
    # Older still: no attn in the model config, and no flags.
    assert run_config_of({"model_config": CFG.to_dict(), "step": 1}) == Config(model=CFG)


def test_run_config_of_a_checkpoint_is_its_config():
    config = CONFIG.replace(model={"window": 8, "window_pattern": "LG"}, optim={"grad_clip": 0.0},
                            data={"data": "d", "pack_documents": True}, run={"keep_checkpoints": 0, "seed": 9})
    assert run_config_of({"config": config.to_dict()}) == config


def test_the_other_kind_of_checkpoint_is_named(tmp_path):
    (tmp_path / "checkpoint_dcp").mkdir()
    model = TransformerLM(CFG, "naive")
    with pytest.raises(ResumeError, match=rf"^no checkpoint-<step>.safetensors in {tmp_path}, but the sharded FSDP "
                                          rf"checkpoint "
                                          rf"{tmp_path}/checkpoint_dcp exists: resume with --parallel fsdp, or "
                                          r"consolidate it first with `python -m training.checkpoint.consolidate "):
        load_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"),
                        CONFIG, DistContext(), no_warning)
    single = tmp_path / "single"
    saved_run(single, CONFIG, torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ResumeError, match="a single-file checkpoint resumes with --parallel ddp or none, not fsdp"):
        load_checkpoint(single, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"),
                        CONFIG.replace(execution={"parallel": "fsdp"}), DistContext(parallel="fsdp"), no_warning)
