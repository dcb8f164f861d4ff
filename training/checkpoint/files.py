"""The checkpoint files of a run: the last K as `<out>/checkpoint-<step>.pt`; a resume loads the newest that loads.

Each checkpoint is written to a temporary file, fsynced and renamed (training.files.write_atomic), so a crash
leaves every earlier checkpoint whole. A file that does not load (truncated, overwritten, empty) is named in a
one-line warning and the next older one is tried. The single `checkpoint.pt` of earlier versions is still read,
as the oldest candidate.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from training.checkpoint.format import CHECKPOINT_NAME as LEGACY_NAME
from training.run.files import write_atomic
_NUMBERED = re.compile(r"checkpoint-(\d+)\.pt")


class CheckpointError(RuntimeError):
    """No checkpoint to resume from; the one-line message names the directory and each file tried."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}.pt"


def numbered(out: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-<step>.pt` in `out`, newest first."""
    found = []
    for p in out.glob("checkpoint-*.pt"):
        m = _NUMBERED.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def candidates(out: Path) -> list[Path]:
    """The checkpoints a resume tries, in order: numbered ones newest first, then the legacy `checkpoint.pt`."""
    paths = [p for _, p in numbered(out)]
    if (out / LEGACY_NAME).is_file():
        paths.append(out / LEGACY_NAME)
    return paths


def save(state: dict[str, Any], out: Path, step: int, keep: int) -> Path:
    """Write `state` as checkpoint-<step>.pt, durably, then delete all but the `keep` newest checkpoints."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    path = out / checkpoint_name(step)
    write_atomic(path, lambda f: torch.save(state, f))
    prune(out, step, keep)
    return path


def prune(out: Path, step: int, keep: int) -> None:
    """Keep the `keep` newest checkpoints up to `step`.

    Checkpoints past `step` are from a timeline this run abandoned: it resumed from an older one because they did
    not load. The legacy `checkpoint.pt` goes once `keep` numbered checkpoints exist.
    """
    kept = 0
    for s, p in numbered(out):
        if s > step or kept >= keep:
            p.unlink(missing_ok=True)
        else:
            kept += 1
    if kept >= keep:
        (out / LEGACY_NAME).unlink(missing_ok=True)


def _reason(e: BaseException, path: Path) -> str:
    """What went wrong, in a few words: the first sentence of the error."""
    try:
        if path.stat().st_size == 0:
            return "the file is empty"
    except OSError:
        pass
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". ")[0].rstrip(".")
    if len(text) > 100:
        text = text[:97] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_file(path: Path) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds RNG states and the config dict, which a run of ours wrote.
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError("not a checkpoint of this trainer (no step)")
    return state


def load_named(path: Path) -> dict[str, Any]:
    """load_file, any failure turned into a one-line CheckpointError that names the file (a checkpoint given by
    name: there is no older one to fall back to)."""
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise CheckpointError(f"checkpoint {path} does not load: {_reason(e, path)}") from None


def load_newest(out: Path, warn: Callable[[str], None] = _stderr,
                load: Callable[[Path], dict[str, Any]] = load_file) -> tuple[Path, dict[str, Any]]:
    """(path, state) of the newest checkpoint in `out` that loads; a one-line warning for each newer one that does
    not; CheckpointError if none does."""
    paths = candidates(out)
    if not paths:
        raise CheckpointError(f"no checkpoint to resume from in {out} (looked for checkpoint-<step>.pt and "
                              f"{LEGACY_NAME})")
    failed = []
    for path in paths:
        try:
            return path, load(path)
        except Exception as e:  # noqa: BLE001 - any file that does not load is skipped, whatever the error
            reason = _reason(e, path)
            failed.append(f"{path.name} ({reason})")
            if path != paths[-1]:
                warn(f"warning: checkpoint {path} does not load ({reason}); trying an older one")
    raise CheckpointError(f"no checkpoint in {out} loads: {'; '.join(failed)}")
