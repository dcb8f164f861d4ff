"""A run's state on disk: the checkpoints it writes, saving them, and resuming from the newest that loads.

One process and DDP keep the last --keep-checkpoints files `<out>/checkpoint-<step>.pt` (training.checkpoint_files);
FSDP writes the sharded directory `<out>/checkpoint_dcp/` (training.sharded_checkpoint). Both hold the model, AdamW,
the gradient scaler, the step (also the data position: batches are drawn by (seed, step)), the RNG states, the model
config and the flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from model import ModelConfig
from training import checkpoint, checkpoint_files, distributed, sharded_checkpoint
from training.distributed import DistContext

# Flags that change how a step runs, not the weights or the optimizer state: a resume may change them.
RUNTIME_FLAGS = ("attn", "dtype", "compile", "compile_scope", "cuda_graph", "activation_checkpointing", "fp8",
                 "grad_accum_steps")


class ResumeError(ValueError):
    """A checkpoint that cannot resume this run (another model, the other kind of checkpoint); the message says why."""


@dataclass(frozen=True)
class Resumed:
    step: int  # the step to continue from
    path: Path  # the checkpoint file (or sharded directory) it came from
    changes: list[str]  # one line per runtime flag that differs from the run that wrote it


def save_checkpoint(out: Path, model: torch.nn.Module, optimizer, scaler: torch.amp.GradScaler, step: int,
                    cfg: ModelConfig, args: argparse.Namespace, ctx: DistContext = DistContext(),
                    keep: int = 2) -> Path:
    """Called on every rank; returns the checkpoint written. DDP's ranks hold identical weights, so rank 0 writes the
    one-process file, and deletes all but the `keep` newest."""
    extras = {
        "scaler": scaler.state_dict(),
        "step": step,  # also the data position: batches are drawn by (seed, step)
        "rng": checkpoint.rng_state(),
        "model_config": cfg.to_dict(),
        "args": vars(args),
    }
    if ctx.parallel == "fsdp":
        path = out / sharded_checkpoint.DCP_DIR_NAME
        sharded_checkpoint.save(path, model, optimizer, extras, ctx)
        return path
    if ctx.is_main:
        checkpoint_files.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extras}, out,
                              step, keep)
    distributed.barrier(ctx)
    return out / checkpoint_files.checkpoint_name(step)


def _read(out: Path, ctx: DistContext, warn: Callable[[str], None]) -> tuple[Path, dict]:
    """(path, state) of the checkpoint to resume from; for FSDP, the state holds the extras only."""
    dcp = out / sharded_checkpoint.DCP_DIR_NAME
    single = checkpoint_files.candidates(out)
    if ctx.parallel == "fsdp":
        if not sharded_checkpoint.exists(dcp) and single:
            raise ResumeError(f"no sharded checkpoint at {dcp}, but {single[0]} exists: a single-file checkpoint "
                              "resumes with --parallel ddp or none, not fsdp")
        return dcp, sharded_checkpoint.load_extras(dcp)
    if not single and dcp.exists():
        raise ResumeError(f"no checkpoint-<step>.pt in {out}, but the sharded FSDP checkpoint {dcp} exists: resume "
                          f"with --parallel fsdp, or consolidate it first with `python -m training.consolidate {dcp} "
                          f"{out / checkpoint.CHECKPOINT_NAME}`")
    return checkpoint_files.load_newest(out, warn)


def flag_changes(saved: dict, args: argparse.Namespace) -> list[str]:
    """One line per runtime flag whose value differs from the run that wrote the checkpoint."""
    lines = []
    for name in RUNTIME_FLAGS:
        if name not in saved or saved[name] == getattr(args, name):
            continue
        flag, now, then = "--" + name.replace("_", "-"), getattr(args, name), saved[name]
        if isinstance(now, bool):
            lines.append(f"resuming {'with' if now else 'without'} {flag}; the checkpoint was written "
                         f"{'without' if now else 'with'} it (the weights do not depend on it)")
        else:
            lines.append(f"resuming with {flag} {now}; the checkpoint was written with {flag} {then} (the weights do "
                         "not depend on it)")
    return lines


def load_checkpoint(out: Path, model: torch.nn.Module, optimizer, scaler: torch.amp.GradScaler, cfg: ModelConfig,
                    args: argparse.Namespace, ctx: DistContext,
                    warn: Callable[[str], None]) -> Resumed:
    """Restore model, optimizer, scaler and RNG from the newest checkpoint in `out` that loads."""
    path, state = _read(out, ctx, warn)
    asked = cfg.to_dict()
    # A checkpoint from before a field existed lacks it: it was written by a model with that field's default (not
    # with what is asked now, which may be a window the old model never had). fp32_weight_grads changes how dW is
    # computed, attn which kernel computes attention, fused_rope which computes RoPE, fp32_residual the dtype of
    # the residual stream under autocast and fused_gate_up how many matmuls run w1 and w3, none what the model is.
    saved = {**ModelConfig().to_dict(), **state["model_config"], "fp32_weight_grads": cfg.fp32_weight_grads,
             "attn": cfg.attn, "fused_rope": cfg.fused_rope, "fp32_residual": cfg.fp32_residual,
             "fused_gate_up": cfg.fused_gate_up}
    if saved != asked:
        diff = {k: (v, asked.get(k)) for k, v in saved.items() if asked.get(k) != v}
        raise ResumeError(f"checkpoint {path} was written for another model: (saved, asked) {diff}")
    if ctx.parallel == "fsdp":
        sharded_checkpoint.load(path, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if state["scaler"]:  # empty when written without fp16: a run resumed with --dtype fp16 starts its scaler anew
        scaler.load_state_dict(state["scaler"])
    checkpoint.set_rng_state(state["rng"])
    return Resumed(state["step"], path, flag_changes(state.get("args", {}), args))
