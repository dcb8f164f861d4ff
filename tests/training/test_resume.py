"""training/resume.py: what a checkpoint must match to resume, and what may change."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model import ModelConfig, TransformerLM
from training import checkpoint_files
from training.distributed import DistContext
from training.resume import ResumeError, load_checkpoint, save_checkpoint

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=64, context_length=16)


def saved_run(out: Path, cfg: ModelConfig, scaler: torch.amp.GradScaler) -> None:
    out.mkdir()
    model = TransformerLM(cfg)
    save_checkpoint(out, model, torch.optim.AdamW(model.parameters()), scaler, 3, cfg,
                    argparse.Namespace(dtype="fp32"))


def resume(out: Path, cfg: ModelConfig, scaler: torch.amp.GradScaler):
    model = TransformerLM(cfg)
    return load_checkpoint(out, model, torch.optim.AdamW(model.parameters()), scaler, cfg,
                           argparse.Namespace(dtype="fp16"), ctx=DistContext(),
                           warn=pytest.fail)


def test_a_scaler_that_was_off_starts_anew_and_one_that_was_on_keeps_its_scale(tmp_path):
    saved_run(tmp_path / "off", CFG, torch.amp.GradScaler("cpu", enabled=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    resumed = resume(tmp_path / "off", CFG, scaler)
    assert resumed.step == 3 and scaler.get_scale() == 2.0 ** 10
    assert resumed.changes == ["resuming with --dtype fp16; the checkpoint was written with --dtype fp32 (the "
                               "weights do not depend on it)"]
    saved_run(tmp_path / "on", CFG, torch.amp.GradScaler("cpu", init_scale=2.0 ** 5))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    resume(tmp_path / "on", CFG, scaler)
    assert scaler.get_scale() == 2.0 ** 5


def test_a_checkpoint_older_than_a_config_field_had_its_default(tmp_path):
    """A field missing from the saved config was the default then: asking for another value is another model."""
    out = tmp_path / "old"
    saved_run(out, CFG, torch.amp.GradScaler("cpu", enabled=False))
    path = checkpoint_files.candidates(out)[0]
    state = checkpoint_files.load_file(path)
    del state["model_config"]["window"]
    torch.save(state, path)
    resume(out, CFG, torch.amp.GradScaler("cpu", enabled=False))  # the default: the same model
    with pytest.raises(ResumeError, match="another model.*'window': \\(None, 8\\)"):
        resume(out, replace(CFG, window=8), torch.amp.GradScaler("cpu", enabled=False))
