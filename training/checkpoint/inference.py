"""A trained model for sampling and evaluation: the checkpoint of a run (its newest that loads, or a named file), or a
Hugging Face Llama directory (training/checkpoint/hf.py), the run's configuration, and the model with its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from model import ModelConfig, TransformerLM
from training.checkpoint import files as checkpoint_files
from training.checkpoint import hf, sharded
from training.checkpoint.files import CheckpointError
from training.checkpoint.resume import model_config_of
from training.cli import apply, flatten
from training.config import Config


def open_checkpoint(run: Path, warn: Optional[Callable[[str], None]] = None,
                    allow_pickle: bool = False, read_sharded: bool = False) -> tuple[Path, dict[str, Any]]:
    """(path, state) of a checkpoint file, of the newest checkpoint of a run directory that loads (intact, with finite
    weights), or of a Hugging Face directory; an earlier version's pickled checkpoint only with allow_pickle.
    read_sharded: an FSDP run's sharded checkpoint (or that directory) is read whole, weights only."""
    if hf.is_hf_dir(run):
        return hf.open_hf(run)
    if read_sharded and sharded.exists(run):
        return run, _sharded_weights(run)
    if run.is_dir():
        if not checkpoint_files.candidates(run):
            dcp = run / sharded.DCP_DIR_NAME
            if read_sharded and sharded.exists(dcp):
                return dcp, _sharded_weights(dcp)
            if dcp.exists():
                raise CheckpointError(f"{run} holds only a sharded FSDP checkpoint; make one file of it with `python -m "
                                      f"training.checkpoint.consolidate {dcp} {run}/consolidated.safetensors "
                                      "--model-only` and pass that file")
            raise CheckpointError(f"no checkpoint in {run} (train one with `python train.py --out {run}`)")
        return checkpoint_files.load_newest(run, **({"warn": warn} if warn else {}), allow_pickle=allow_pickle)
    if not run.is_file():
        raise CheckpointError(f"no checkpoint at {run}")
    return run, checkpoint_files.load_named(run, allow_pickle)


def _sharded_weights(dcp: Path) -> dict[str, Any]:
    """A sharded checkpoint's weights (without the optimizer's moments) and extras, in this one process."""
    extras = {k: v for k, v in sharded.load_extras(dcp).items() if k != "optimizer"}
    return {"model": sharded.load_full(dcp, keys={"model"})["model"], **extras}


def run_config_of(state: dict[str, Any]) -> Config:
    """The configuration of the run that wrote a checkpoint (an earlier version's: its model and flags)."""
    if "config" in state:
        return apply(Config(), flatten(state["config"]))
    args = state.get("args", {})
    legacy = {("data", "data"): args.get("data"), ("data", "batch_size"): args.get("batch_size", 16),
              ("run", "eval_batches"): args.get("eval_batches", 10), ("run", "seed"): args.get("seed", 0),
              ("execution", "attn"): state["model_config"].get("attn", "sdpa"),
              ("execution", "dtype"): args.get("dtype")}
    return apply(Config(model=model_config_of(state)), legacy)


def load_model(path: Path, state: dict[str, Any], cfg: ModelConfig, attn: str, device: torch.device) -> TransformerLM:
    """The checkpoint's model with its weights on `device`; a state dict of another shape is a CheckpointError."""
    with device:
        model = TransformerLM(cfg, attn)
    expected = model.state_dict()
    for name, tensor in state["model"].items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"checkpoint {path} holds another model shape than its config says: {name} is "
                                  f"{tuple(tensor.shape)} in the file, {tuple(expected[name].shape)} for d_model "
                                  f"{cfg.d_model}, n_heads {cfg.n_heads}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}")
    missing = sorted(set(expected) - set(state["model"]))
    unexpected = sorted(set(state["model"]) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} holds another model shape than its config says ({cfg.n_layers} "
                              f"layers): missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict(state["model"])
    return model
