"""A sweep stopped by SIGTERM (a time limit) or Ctrl-C stops within seconds, even inside one long C++ call, and still
writes the rows it measured."""

import csv
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarking.interruption import (STOPPED_STATUS, note_interrupted, sigterm_as_interrupt, stop_reason,
                                      stops_promptly)

REPO = Path(__file__).resolve().parents[2]
STOP_BOUND_S = 15.0  # the watchdog's 3 s of grace, writing the files and exiting, on a loaded 2-core machine


def test_sigterm_becomes_keyboard_interrupt_and_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler fires before this ends
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_block_left_in_time_stands_the_watchdog_down():
    written = []
    threads = threading.active_count()
    with pytest.raises(KeyboardInterrupt) as interrupt:
        with stops_promptly(written.append, grace_s=0.5):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # Python code: the KeyboardInterrupt lands at once
    time.sleep(1)  # past the grace: the watchdog must not write or end the process now
    assert stop_reason(interrupt.value) == "SIGTERM" and written == []
    assert threading.active_count() == threads
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd is given back


def test_the_stop_note_survives_a_closed_stderr(monkeypatch):
    # Ctrl-C on `bench_attention.py ... 2>&1 | tee log` ends tee too: the note must not stop the files being written.
    closed = open(os.devnull, "w")
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert note_interrupted(3, 8, "Ctrl-C (SIGINT)", "the point b1") == (
        "sweep stopped early by Ctrl-C (SIGINT): 3 of 8 runs done; the point b1 was being measured and is left out; "
        "writing the results so far")


# One matmul of about a teraFLOP: a single C++ call of many seconds, during which Python runs no signal handler.
LONG_CALL = """
import sys, torch
from benchmarking.interruption import stops_promptly
a = torch.randn(8192, 8192)
with stops_promptly(lambda reason: open(sys.argv[1], "w").write(reason)):
    print("ready", flush=True)
    for _ in range(100):
        a @ a
"""


@pytest.mark.slow  # a fresh Python importing torch
def test_the_watchdog_ends_a_long_call_and_writes_what_it_has(tmp_path):
    marker = tmp_path / "written"
    proc = subprocess.Popen([sys.executable, "-c", LONG_CALL, str(marker)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1)  # inside the first matmul
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert time.monotonic() - sent < STOP_BOUND_S
    finally:
        proc.kill()
    assert code == STOPPED_STATUS
    assert marker.read_text() == "SIGTERM"


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _stop_inside_second_point(argv: list[str], out: Path, second: str, settle_s: float,
                              timeout_s: float = 240) -> tuple[int, float]:
    """Start the sweep, wait for the first rows in results.csv and for the progress line of the point labelled with
    `second`, then `settle_s` more (its set-up), and send SIGTERM into that point's first long call; (exit status,
    seconds it took to exit)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *argv, "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:  # drained all along: a full pipe would block the sweep
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        while not ((out / "results.csv").exists() and _rows(out / "results.csv") and any(second in l for l in lines)):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the sweep did not reach its second point:\n" + "".join(lines)
            time.sleep(0.2)
        # Inside the first call of the warm-up, which runs half a minute or more on two cores: the stop used to wait
        # for it to end (29 s for bench_attention, 95 s for bench_model here). On a machine slow enough that the
        # set-up outlasts settle_s the signal lands in Python code instead, and the test still holds.
        time.sleep(settle_s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        return code, time.monotonic() - sent
    finally:
        proc.kill()


@pytest.mark.slow  # bench_attention.py in a subprocess
def test_bench_attention_stops_within_seconds_and_keeps_the_finished_points(tmp_path):
    out = tmp_path / "attn"
    code, took = _stop_inside_second_point(["bench_attention.py", "--backends", "sdpa", "--seq-lens", "64,32768",
                                            "--heads", "16", "--d-heads", "64", "--dtype", "fp32", "--iters", "5",
                                            "--warmup", "1", "--no-plots"], out, "seq=32768", settle_s=1.5)
    assert code == STOPPED_STATUS and took < STOP_BOUND_S, took
    rows = _rows(out / "results.csv")
    assert [(r["seq"], r["status"]) for r in rows] == [("64", "ok")]  # the second point is dropped
    assert (out / "results.json").exists()
    text = (out / "results.md").read_text()
    assert "stopped early by SIGTERM" in text and "b1 h16 seq=32768 d=64 fp32 causal was being measured" in text


@pytest.mark.slow  # bench_model.py in a subprocess
def test_bench_model_stops_within_seconds_and_keeps_the_finished_rows(tmp_path):
    out = tmp_path / "model"
    code, took = _stop_inside_second_point(["bench_model.py", "--d-model", "256", "--n-layers", "1", "--n-heads", "2",
                                            "--d-ff", "64", "--vocab-size", "64", "--context-lengths", "8,65536",
                                            "--batch-size", "2", "--warmup", "1", "--steps", "3", "--device", "cpu"],
                                           out, "T=65536", settle_s=5)  # its line comes before the model is built
    assert code == STOPPED_STATUS and took < STOP_BOUND_S, took
    assert [r["context_length"] for r in _rows(out / "results.csv")] == ["8"]
    assert (out / "results.json").exists()
    assert "T=65536" in (out / "results.md").read_text()  # named as the configuration left out
