"""The README's first command, its resume and its sample line, run as the README writes them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _readme_command(pattern: str) -> list[str]:
    """The README line matching `pattern`, as `python SCRIPT ARGS...` with this interpreter and the repo's script."""
    match = re.search(pattern, README, re.MULTILINE)
    assert match, f"README.md has no line matching {pattern!r}"
    words = shlex.split(match.group(1), comments=True)
    script, args = words[0], words[1:]
    return [sys.executable, str(ROOT / script), *args]


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(cmd[1:])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout + done.stderr


@pytest.mark.slow
def test_command_one_then_resume_then_sample(tmp_path: Path) -> None:
    train = _readme_command(r"^\./setup\.sh && \.venv/bin/python (train\.py --size tiny .*)$")
    resume_args = re.search(r"continue it with `(--resume --steps \d+)`", README)
    assert resume_args, "README.md no longer says how to continue command 1's run"
    sample = _readme_command(r"^python (sample\.py --out runs/train .*)$")

    out = _run(train, tmp_path)
    steps = int(train[train.index("--steps") + 1])
    assert (tmp_path / "runs/train" / f"checkpoint-{steps}.safetensors").is_file(), out
    assert "final:" in out and "next:" in out

    resumed_steps = int(resume_args.group(1).split()[-1])
    out = _run([*train[:2], *shlex.split(resume_args.group(1))], tmp_path)
    assert (tmp_path / "runs/train" / f"checkpoint-{resumed_steps}.safetensors").is_file(), out

    text = _run(sample, tmp_path)
    assert len(text.strip()) > 0
