"""A run's checkpoint as a Hugging Face Llama directory (export.py): checked, then written whole or not at all.

What a Llama config cannot express is refused unless accepted (`accept_mismatch`): sliding windows, the attention
and logit softcaps and QK-norm change what the model computes, and a run trained on packed documents saw RoPE
positions restart at each document, which Llama's positions do not. Accepted, the weights are exported all the same and the
mismatch is recorded under config.json's "flash_lm" key. A ReLU² MLP is refused always: Llama's MLP has three
matrices, so its weights have nowhere to go.

The directory is written under a temporary name beside its target and renamed into place, so a failure leaves no
half-written export: either the old directory (or none) or the new one.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from model import hf_llama
from training.checkpoint import hf
from training.checkpoint.inference import open_checkpoint, run_config_of
from training.config import Config
from training.data.record import data_note
from training.data.tokenizer import EOD_TOKEN, TOKENIZER_FILE
from training.run.files import fsync_dir, temp_path


class ExportError(RuntimeError):
    """An export that cannot be done as asked; the one-line message says why and what to pass."""


@dataclass(frozen=True)
class Exported:
    directory: Path
    checkpoint: Path  # the checkpoint file (or sharded directory) exported
    step: int
    parameters: int
    files: list[Path]
    mismatches: list[str]  # what a Llama config cannot express, exported anyway (accept_mismatch)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mismatches(config: Config) -> list[str]:
    """What of a run a Llama config cannot express, one phrase each; empty for a plain Llama."""
    found = hf_llama.mismatches(config.model)
    if config.data.pack_documents:
        found.append("training on packed documents (--pack-documents: RoPE positions restarted at each document)")
    return found


def check_target(out: Path, source: Path, overwrite: bool) -> None:
    """The directory to write: new, empty, or replaced with `overwrite`; never one that holds `source`."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    target, src = out.resolve(), source.resolve()
    if target == src or target in src.parents:
        raise ExportError(f"{out} holds the checkpoint being exported ({source}): export to another directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty: pass --overwrite to replace it")


def tokenizer_of(run_dir: Path) -> tuple[Optional[tuple[Path, str]], Optional[int]]:
    """(tokenizer.json and its end-of-document token, or None; the end-of-document id, or None) of a run: the
    tokenizer its data recorded (training/data/record.py). Bytes have no tokenizer file; plain text has no
    end-of-document token."""
    note = data_note(run_dir)
    if note is None or note.get("tokenizer") is None:  # text read as bytes, token files, synthetic tokens
        return None, None
    if note["tokenizer"] == "bytes":
        return None, note.get("eod_id")
    return (run_dir / TOKENIZER_FILE, note.get("eod_token", EOD_TOKEN)), note.get("eod_id")


def replace_dir(out: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """write(temporary directory) beside `out`, then rename it to `out` (an existing `out` is moved aside first and
    removed after); the files, under `out`. On an error the temporary directory goes and `out` is untouched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = temp_path(out), temp_path(out)
    tmp.mkdir()
    try:
        files = write(tmp)
        if out.exists():
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)  # the old directory back where it was
                raise
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return [out / f.name for f in files]


def export_hf(run: Path, out: Path, ckpt: Optional[Path] = None, overwrite: bool = False,
              accept_mismatch: bool = False, warn: Callable[[str], None] = _stderr) -> Exported:
    """Export the newest good checkpoint of `run` (or `ckpt`; an FSDP run's sharded one too) to `out`, with the
    run's tokenizer. ExportError (or CheckpointError) when it cannot, before anything is written."""
    source = ckpt or run
    check_target(out, source, overwrite)
    path, state = open_checkpoint(source, warn, read_sharded=True)
    config = run_config_of(state)
    if config.model.mlp != "swiglu":
        raise ExportError(f"a Llama checkpoint cannot hold this run's {config.model.mlp} MLP (Llama's is SwiGLU, with "
                          "three matrices), not even with --accept-mismatch")
    found = mismatches(config)
    if found and not accept_mismatch:
        raise ExportError(f"a Llama config cannot express this run's {'; '.join(found)}: pass --accept-mismatch to "
                          "export the weights anyway (transformers will compute another function)")
    for phrase in found:
        warn(f"warning: exported anyway: a Llama config cannot express {phrase}")
    tokenizer, eod_id = tokenizer_of(run if run.is_dir() else run.parent)
    ours = {"step": state.get("step"), "checkpoint": str(path), "config": config.to_dict(),
            **({"mismatch": found} if found else {})}
    files = replace_dir(out, lambda tmp: hf.write_hf(tmp, state["model"], config.model, eod_id, tokenizer, ours))
    parameters = sum(t.numel() for t in state["model"].values())
    return Exported(out, path, state.get("step", 0), parameters, files, found)
