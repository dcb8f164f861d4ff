"""The checkpoint files of a run: the last K as `<out>/checkpoint-<step>.safetensors`; a resume loads the newest
that loads.

Each checkpoint is written to a temporary file, fsynced and renamed (format.save), so a crash leaves every earlier
checkpoint whole. A file that does not load (truncated, damaged, non-finite weights, empty) is named in a one-line
warning and the next older one is tried. The `checkpoint-<step>.pt` and `checkpoint.pt` files of earlier versions
are still candidates, after the current ones of the same step; they load with `allow_pickle` (format.load_legacy).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

from training.checkpoint import format
from training.checkpoint.format import LEGACY_NAME

SUFFIX = ".safetensors"
_NUMBERED = re.compile(r"checkpoint-(\d+)(\.safetensors|\.pt)")


class CheckpointError(RuntimeError):
    """No checkpoint to load; the one-line message names the directory or file and what is wrong with each tried."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}{SUFFIX}"


def numbered(out: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-<step>.safetensors` (and earlier versions' `.pt`) in `out`, newest first,
    the current format first at equal steps."""
    found = []
    for p in out.glob("checkpoint-*"):
        m = _NUMBERED.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), m.group(2) == SUFFIX, p))
    return [(step, p) for step, _, p in sorted(found, reverse=True)]


def candidates(out: Path) -> list[Path]:
    """The checkpoints a resume tries, in order: numbered ones newest first, then the legacy `checkpoint.pt`."""
    paths = [p for _, p in numbered(out)]
    if (out / LEGACY_NAME).is_file():
        paths.append(out / LEGACY_NAME)
    return paths


def save(state: dict[str, Any], out: Path, step: int, keep: int) -> Path:
    """Write `state` as checkpoint-<step>.safetensors, durably, then delete all but the `keep` newest checkpoints."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    path = out / checkpoint_name(step)
    format.save(state, path)
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
    if isinstance(e, format.CheckpointFormatError):
        return str(e)
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


def load_file(path: Path, allow_pickle: bool = False) -> dict[str, Any]:
    """A checkpoint file of either format, checked (format.load); an earlier version's only with allow_pickle."""
    if path.suffix == SUFFIX:
        state = format.load(path)
    else:
        state = format.load_legacy(path, allow_pickle)
        bad = format.nonfinite(state.get("model", {})) if isinstance(state, dict) else None
        if bad:
            raise format.CheckpointFormatError(f"its weights are not finite ({bad})")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise format.CheckpointFormatError("not a checkpoint of this trainer (no step)")
    return state


def load_named(path: Path, allow_pickle: bool = False) -> dict[str, Any]:
    """load_file, any failure turned into a one-line CheckpointError that names the file (a checkpoint given by
    name: there is no older one to fall back to)."""
    try:
        return load_file(path, allow_pickle)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise CheckpointError(f"checkpoint {path} does not load: {_reason(e, path)}") from None


def load_newest(out: Path, warn: Callable[[str], None] = _stderr, allow_pickle: bool = False,
                load: Callable[[Path], dict[str, Any]] | None = None) -> tuple[Path, dict[str, Any]]:
    """(path, state) of the newest checkpoint in `out` that loads (intact, finite); a one-line warning for each newer
    one that does not; CheckpointError if none does."""
    load = load or (lambda path: load_file(path, allow_pickle))
    paths = candidates(out)
    if not paths:
        raise CheckpointError(f"no checkpoint to resume from in {out} (looked for checkpoint-<step>{SUFFIX})")
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
