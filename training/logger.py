"""Metrics sinks: one JSON object per log step in metrics.jsonl (training.metrics_file), the same keys in W&B."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional

from training.metrics_file import METRICS_FILE, MetricsFile


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class MetricsLogger:
    """Writes metrics to `<out>/metrics.jsonl` and, unless wandb_mode is 'disabled', to a W&B run.

    W&B 'offline' (the default) writes the run under `<out>/wandb/`; upload later with `wandb sync <out>/wandb/offline-run-*`.
    """

    def __init__(self, out_dir: Path, wandb_mode: str, project: str, config: dict, run_name: Optional[str] = None,
                 append: bool = False):
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode must be offline, online or disabled, got {wandb_mode!r}")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / METRICS_FILE
        self._file = MetricsFile(self.path, append=append)
        self.wandb_run = None
        self.wandb_dir: Optional[Path] = None  # an offline run's directory, for `wandb sync`
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(project=project, dir=str(out_dir), mode=wandb_mode, config=config,
                                        name=run_name, reinit="finish_previous")
            if wandb_mode == "offline":
                self.wandb_dir = Path(self.wandb_run.dir).parent

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Raises training.metrics_file.MetricsError, naming the file, when the row cannot be written."""
        row = {"step": step, **metrics}
        self._file.write({k: _jsonable(v) for k, v in row.items()})
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def sync(self) -> None:
        """Make the rows logged so far durable (before a checkpoint that covers them)."""
        self._file.sync()

    def summary(self, figures: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            for k, v in figures.items():
                if v is not None:
                    self.wandb_run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None


class NullLogger:
    """The logger of ranks other than 0 in a multi-process run: rank 0 alone writes metrics.jsonl and W&B."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass

    def summary(self, figures: dict[str, Any]) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass
