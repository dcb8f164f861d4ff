"""A run's state on disk: saving it, and resuming from the newest checkpoint that loads.

One process and DDP keep the last --keep-checkpoints files `<out>/checkpoint-<step>.safetensors` (files.py); FSDP writes the
sharded directory `<out>/checkpoint_dcp/` (sharded.py). Both hold the model, the optimizer state keyed by parameter
name (so it loads into any arrangement of optimizers: one, or one per parameter when stepped in the backward), the
gradient scaler, the step (also the data position: batches are drawn by (seed, step)), the RNG states and the run's
configuration. A checkpoint resumes a run whose model has the same architecture; how it runs may change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from model import ModelConfig
from training.checkpoint import files as checkpoint_files
from training.checkpoint import format as checkpoint
from training.checkpoint import sharded as sharded_checkpoint
from training.config import Config, ExecutionConfig, as_flags
from training.parallel import distributed
from training.parallel.distributed import DistContext


class ResumeError(ValueError):
    """A checkpoint that cannot resume this run (another model, the other kind of checkpoint); the message says why."""


@dataclass(frozen=True)
class Resumed:
    step: int  # the step to continue from
    path: Path  # the checkpoint file (or sharded directory) it came from
    changes: list[str]  # one line per setting of how the run runs that differs from the run that wrote it
    extra: dict[str, Any]  # what the writer passed as save_checkpoint's `extra`


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside `optimizer` (one per partition when stepped in the backward)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def model_config_of(state: dict[str, Any]) -> ModelConfig:
    """The architecture a checkpoint was written for (older checkpoints keep it under "model_config")."""
    saved = state["config"]["model"] if "config" in state else state["model_config"]
    return ModelConfig.from_dict(saved)


def save_checkpoint(out: Path, model: torch.nn.Module, optimizer: Any, scaler: torch.amp.GradScaler, step: int,
                    config: Config, ctx: DistContext = DistContext(), keep: int = 2,
                    extra: Optional[dict[str, Any]] = None) -> Path:
    """Called on every rank; returns the checkpoint written. DDP's ranks hold identical weights, so rank 0 writes the
    one-process file, and deletes all but the `keep` newest. `extra`: JSON values of the writer's own, which
    load_checkpoint gives back (Resumed.extra)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    extras = {"scaler": scaler.state_dict(), "step": step, "rng": checkpoint.rng_state(), "config": config.to_dict(),
              "extra": extra or {}}
    if ctx.parallel == "fsdp":
        path = out / sharded_checkpoint.DCP_DIR_NAME
        sharded_checkpoint.save(path, model, optimizer, extras, ctx)
        return path
    if ctx.is_main:
        optim_state = get_optimizer_state_dict(model, optimizers_of(optimizer))
        checkpoint_files.save({"model": model.state_dict(), "optimizer": optim_state, **extras}, out, step, keep)
    distributed.barrier(ctx)
    return out / checkpoint_files.checkpoint_name(step)


def _read(out: Path, ctx: DistContext, warn: Callable[[str], None], allow_pickle: bool) -> tuple[Path, dict]:
    """(path, state) of the checkpoint to resume from; for FSDP, the state holds the extras only."""
    dcp = out / sharded_checkpoint.DCP_DIR_NAME
    single = checkpoint_files.candidates(out)
    if ctx.parallel == "fsdp":
        if not sharded_checkpoint.exists(dcp) and single:
            raise ResumeError(f"no sharded checkpoint at {dcp}, but {single[0]} exists: a single-file checkpoint "
                              "resumes with --parallel ddp or none, not fsdp")
        try:
            return dcp, sharded_checkpoint.load_extras(dcp)
        except checkpoint.CheckpointFormatError as e:
            raise checkpoint_files.CheckpointError(f"sharded checkpoint {dcp} does not load: {e}") from None
    if not single and dcp.exists():
        raise ResumeError(f"no checkpoint-<step>{checkpoint_files.SUFFIX} in {out}, but the sharded FSDP checkpoint "
                          f"{dcp} exists: resume with --parallel fsdp, or consolidate it first with `python -m "
                          f"training.checkpoint.consolidate {dcp} {out}/checkpoint-<its step>{checkpoint_files.SUFFIX}`")
    return checkpoint_files.load_newest(out, warn, allow_pickle)


def execution_changes(state: dict[str, Any], config: Config) -> list[str]:
    """One line per execution setting that differs from the run that wrote the checkpoint."""
    saved = state.get("config", {}).get("execution", {})
    lines = []
    for f in fields(ExecutionConfig):
        then, now = saved.get(f.name), getattr(config.execution, f.name)
        if f.name in saved and then != now and f.name != "device":
            lines.append(as_flags(f"resuming with {f.name} {now}; the checkpoint was written with {then} (the weights "
                                  "do not depend on it)"))
    return lines


def check_architecture(path: Path, state: dict[str, Any], model_config: ModelConfig) -> None:
    saved, asked = model_config_of(state).to_dict(), model_config.to_dict()
    diff = [name for name in asked if saved.get(name) != asked[name]]
    if diff:
        listed = ", ".join(as_flags(f"{name} {saved.get(name)} (asked {asked[name]})") for name in diff)
        raise ResumeError(f"checkpoint {path} was written for another model: {listed}")


def check_optimizer_state(path: Path, state: dict[str, Any], optimizer: str) -> None:
    """The checkpoint's optimizer state must be one this run's optimizer continues from: the same layout (adamw's
    moments load into adamw-bf16 and back; Muon's momentum does not)."""
    from training.optim.registry import state_layout

    saved = state.get("config", {}).get("optim", {}).get("optimizer")
    if saved is not None and state_layout(saved) != state_layout(optimizer):
        raise ResumeError(f"checkpoint {path} holds the state of --optimizer {saved}, which --optimizer {optimizer} "
                          f"cannot continue from: resume with --optimizer {saved}, or start a new run")


def _legacy_by_name(model: torch.nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """An earlier version's optimizer state keyed by parameter name: one optimizer's, keyed by position over its
    groups (the matrices, then the other parameters, as it built them), or one per parameter's (--overlap-optimizer)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if "overlapped_partitions" in saved:
        parts = list(zip((n for n, _ in params), saved["overlapped_partitions"]))
        return {"state": {n: s for n, part in parts for s in part["state"].values()},
                "param_groups": [{**part["param_groups"][0], "params": [n]} for n, part in parts]}
    order = [n for n, p in params if p.dim() >= 2] + [n for n, p in params if p.dim() < 2]
    return {"state": {order[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer: Any, saved: dict[str, Any]) -> None:
    """An optimizer state keyed by parameter name into `optimizer`; an earlier version's index-keyed one too."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if "overlapped_partitions" in saved or any(isinstance(k, int) for k in saved.get("state", {})):
        saved = _legacy_by_name(model, saved)
    set_optimizer_state_dict(model, optimizers_of(optimizer), saved)


def keep_hyperparameters(optimizer: Any, built: list[dict[str, Any]]) -> None:
    """After loading an optimizer state, each group gets back the settings this run built it with (the run's
    configuration decides --weight-decay, --embed-lr-scale and the kind of learning rate: a device tensor under a CUDA
    graph); the checkpoint gives only the state. Loading by parameter name hands each group the settings of the saved
    group that held its first parameter, which differ where the groups do."""
    for group, settings in zip(optimizer.param_groups, built, strict=True):
        params = group["params"]
        group.clear()
        group.update(settings, params=params)
    # torch placed each step count by the saved group's flags: a checkpoint of a run without fused or capturable AdamW
    # (the CPU's) leaves it on the CPU, where the fused and graphed updates this run's groups now ask for need it on
    # the parameter's device, in fp32.
    for opt in optimizers_of(optimizer):
        for group in opt.param_groups:
            if group.get("fused") or group.get("capturable"):
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def load_checkpoint(out: Path, model: torch.nn.Module, optimizer: Any, scaler: torch.amp.GradScaler,
                    config: Config, ctx: DistContext, warn: Callable[[str], None]) -> Resumed:
    """Restore model, optimizer, scaler and RNG from the newest checkpoint in `out` that loads."""
    path, state = _read(out, ctx, warn, config.run.allow_pickle)
    check_architecture(path, state, config.model)
    check_optimizer_state(path, state, config.optim.optimizer)
    built = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if ctx.parallel == "fsdp":
        sharded_checkpoint.load(path, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        load_optimizer_state(model, optimizer, state["optimizer"])
    keep_hyperparameters(optimizer, built)
    if state["scaler"]:  # empty when written without fp16: a run resumed with --dtype fp16 starts its scaler anew
        scaler.load_state_dict(state["scaler"])
    checkpoint.set_rng_state(state["rng"])
    return Resumed(state["step"], path, execution_changes(state, config), state.get("extra", {}))
