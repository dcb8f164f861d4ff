"""A sweep stopped by SIGTERM (a time limit) or Ctrl-C still writes the rows it measured."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarking.interruption import sigterm_as_interrupt

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_becomes_keyboard_interrupt_and_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler fires before this ends
    assert signal.getsignal(signal.SIGTERM) is before


def _stop_after_first_rows(argv: list[str], out: Path, timeout_s: float = 120) -> int:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while not (out / "results.csv").exists():  # written after the first point finishes
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the sweep wrote no partial results"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return proc.returncode


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_bench_attention_keeps_rows_when_terminated(tmp_path):
    out = tmp_path / "attn"
    seqs = ",".join(str(16 * i) for i in range(1, 41))  # 40 points: far more than run before the signal
    code = _stop_after_first_rows(["bench_attention.py", "--backends", "naive", "--seq-lens", seqs, "--d-heads", "16",
                                   "--dtype", "fp32", "--iters", "20", "--warmup", "1", "--no-plots", "--out", str(out)],
                                  out)
    assert code == 130
    rows = _rows(out / "results.csv")
    assert 1 <= len(rows) < 40 and all(r["status"] == "ok" for r in rows)
    assert (out / "results.md").exists() and (out / "results.json").exists()


def test_bench_model_keeps_rows_when_terminated(tmp_path):
    out = tmp_path / "model"
    contexts = ",".join(str(8 * i) for i in range(1, 31))
    code = _stop_after_first_rows(["bench_model.py", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
                                   "--d-ff", "64", "--vocab-size", "64", "--context-lengths", contexts,
                                   "--batch-size", "2", "--warmup", "1", "--steps", "3", "--device", "cpu",
                                   "--out", str(out)], out)
    assert code == 130
    rows = _rows(out / "results.csv")
    assert 1 <= len(rows) < 30
    assert (out / "results.md").exists() and (out / "results.json").exists()
