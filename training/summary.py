"""What a finished run prints last: how far it got, its final figures, where its files are, and what to run next."""

from __future__ import annotations

import shlex
from typing import Any

from training.progress import duration


def summary_lines(trainer: Any, state: Any) -> list[str]:
    """trainer: training.trainer.Trainer; state: the RunState its fit() returned."""
    out, run = trainer.out, trainer.config.run
    m = state.metrics
    ended = "done" if state.exit_code == 0 else f"stopped (exit status {state.exit_code})"
    lines = [f"{ended}: step {state.step} of {run.steps} in {duration(state.seconds)}"]
    figures = [f"train loss {m['loss']:.4f}"] if "loss" in m else []
    if "val_loss" in m:
        figures.append(f"val loss {m['val_loss']:.4f}")
    if "val_bpb" in m:
        figures.append(f"{m['val_bpb']:.4f} bits per byte")
    if figures:
        lines.append("final: " + ", ".join(figures))
    lines.append(f"checkpoint: {state.checkpoint}" if state.checkpoint else "checkpoint: none written")
    lines.append(f"metrics: {out / 'metrics.jsonl'}; config: {out / 'config.json'}")
    wandb_dir = getattr(trainer.logger, "wandb_dir", None)
    if wandb_dir is not None:
        lines.append(f"W&B: {wandb_dir} (upload it with: wandb sync {shlex.quote(str(wandb_dir))})")
    if state.checkpoint:
        q = shlex.quote(str(out))
        lines.append(f"next: python sample.py --out {q} --prompt 'def '   |   python evaluate.py {q}   |   "
                     f"python train.py --resume --out {q} --steps {2 * run.steps}")
    return lines
