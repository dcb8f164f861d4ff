"""train.py never loses a run: kills at any moment, signals, locked and reused run directories, torn files, bad
inputs. CPU only, with the tiny model of `T` below.

The runs that get killed are forked from this process (torch and train.py already imported), so each costs its
training time only, not a Python start-up: the fault-injection test kills 24 of them in well under a minute.
"""

from __future__ import annotations

import io
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import safetensors.torch
import torch

import train
from training import metrics_file, trainer
from training.checkpoint import files as checkpoint_files
from training.run.directory import LOCK_NAME
from training.step import TrainingStep

T = ["--device", "cpu", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128",
     "--context-length", "64", "--batch-size", "8", "--wandb", "disabled", "--eval-batches", "1",
     "--warmup-steps", "2"]


def argv(text_file: Path, out: Path, *extra: str) -> list[str]:
    return [*T, "--data", str(text_file), "--out", str(out), *extra]


def rows(out: Path) -> list[dict]:
    return metrics_file.read_rows(out / "metrics.jsonl", warn=lambda m: pytest.fail(f"unexpected warning: {m}"))


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `directory` with its size, modification time and content."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns,
                                            p.read_bytes() if p.is_file() else b"")
            for p in sorted(directory.rglob("*"))}


# ------------------------------------------------------------------------------------------- forked runs


class Forked:
    """train.main(argv) in a forked child; its stdout and stderr go to `log`. `patch(notify)` runs in the child
    first: it can make the child report moments (a checkpoint write half done) through notify(tag)."""

    def __init__(self, args: list[str], log: Path, patch: Optional[Callable[[Callable[[bytes], None]], None]] = None):
        self.log = log
        log.write_bytes(b"")  # here, not in the child: a kill before the child runs leaves an empty log, not none
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                os.close(read)
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdout = sys.stderr = io.TextIOWrapper(os.fdopen(fd, "wb", buffering=0), write_through=True)
                torch.set_num_threads(1)
                if patch is not None:
                    patch(lambda tag: os.write(write, tag))
                code = train.main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(write)
        self._events = read
        self.status: Optional[int] = None

    def wait_for(self, tag: bytes, timeout: float = 30.0) -> bool:
        """Whether the child reported `tag` before it exited (or the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._events], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            data = os.read(self._events, 1)
            if not data:
                return False  # the child exited
            if data == tag:
                return True
        return False

    def kill(self, signum: int = signal.SIGKILL) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        if self.status is None:
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            os.close(self._events)
        return self.status

    @property
    def output(self) -> str:
        return self.log.read_text()


def slow_writes(which: set[str]) -> Callable[[Callable[[bytes], None]], None]:
    """A child patch: every training step reports b"s" when done; the writes named in `which` stop half way, report
    it, and finish 0.3 s later, so that a kill on the report lands inside them. "checkpoint": the safetensors file
    of a checkpoint (b"c"); "metrics": a metrics row (b"m"; half a row on disk: a torn line); "cut": the rewrite of
    metrics.jsonl on resume (b"r")."""

    def patch(notify: Callable[[bytes], None]) -> None:
        real_write_atomic = metrics_file.write_atomic

        def save_file(tensors, filename, metadata=None):
            data = safetensors.torch.save(tensors, metadata=metadata)
            with open(filename, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                notify(b"c")
                time.sleep(0.3)
                f.write(data[len(data) // 2:])

        def write_row(self, row):
            data = (json.dumps(row) + "\n").encode()
            fd = self._file.fileno()
            os.write(fd, data[: len(data) // 2])
            notify(b"m")
            time.sleep(0.3)
            os.write(fd, data[len(data) // 2:])

        def cut(path, write):
            notify(b"r")
            time.sleep(0.3)
            real_write_atomic(path, write)

        real_step = TrainingStep.__call__

        def step(self, *args, **kwargs):
            result = real_step(self, *args, **kwargs)
            notify(b"s")
            return result

        TrainingStep.__call__ = step
        if "checkpoint" in which:
            safetensors.torch.save_file = save_file
        if "metrics" in which:
            metrics_file.MetricsFile.write = write_row
        if "cut" in which:
            metrics_file.write_atomic = cut

    return patch


# ------------------------------------------------------------------------------------------ fault injection


def _wait_for_the_moment(child: Forked, kind: str, rng: random.Random) -> None:
    """Let `child` run to the moment a kill of this kind aims at."""
    if kind == "start-up":
        time.sleep(rng.uniform(0.0, 0.2))
    elif kind == "random":  # after a few steps, at any moment of one
        for _ in range(rng.randint(1, 5)):
            assert child.wait_for(b"s"), child.output
        time.sleep(rng.uniform(0.0, 0.05))
    else:
        tag = {"checkpoint": b"c", "metrics": b"m", "cut": b"r"}[kind]
        for _ in range(1 if kind == "cut" else rng.randint(1, 3)):
            assert child.wait_for(tag), child.output


def _assert_intact(out) -> None:
    """Every checkpoint on disk loads; metrics hold one row per step from 1 on (a torn last line at most), at least
    up to the newest checkpoint."""
    for step, path in checkpoint_files.numbered(out):
        assert checkpoint_files.load_file(path)["step"] == step
    logged = [r["step"] for r in metrics_file.read_rows(out / "metrics.jsonl", warn=lambda m: None)]
    assert logged == list(range(1, len(logged) + 1))
    if checkpoint_files.numbered(out):
        assert len(logged) >= checkpoint_files.numbered(out)[0][0]


@pytest.mark.slow  # 26 killed runs, each resumed
def test_sigkill_at_random_moments_never_loses_the_run(tmp_path, text_file):
    """26 runs killed with SIGKILL: at start-up, at random moments of training, and in the middle of writing a
    checkpoint, a metrics row, or the metrics file cut on resume; each time the next run resumes. The final run's
    metrics are those of an uninterrupted run, loss for loss."""
    steps = 150
    flags = ["--steps", str(steps), "--log-every", "1", "--ckpt-every", "1", "--eval-every", "0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the children's count: the same arithmetic, so the same losses
    try:
        # Uninterrupted, in this process: it also warms up what the forked children inherit (their first step
        # then takes milliseconds, not half a second).
        assert train.main(argv(text_file, tmp_path / "straight", *flags)) == 0
    finally:
        torch.set_num_threads(threads)
    straight = rows(tmp_path / "straight")
    assert [r["step"] for r in straight] == list(range(1, steps + 1))

    out = tmp_path / "run"
    run = argv(text_file, out, *flags)
    rng = random.Random(0)
    kinds = ["start-up"] * 2 + ["random"] * 8 + ["checkpoint"] * 6 + ["metrics"] * 6 + ["cut"] * 4
    rng.shuffle(kinds)
    kills = 0
    for i, kind in enumerate(kinds):
        newest = checkpoint_files.numbered(out)[0][0] if out.exists() and checkpoint_files.numbered(out) else None
        if kind == "cut" and newest is None:  # nothing to resume, so no rewrite of the metrics to kill
            kind = "checkpoint"
        child = Forked(run + (["--resume"] if newest is not None else ["--overwrite"]), tmp_path / f"child-{i}.log",
                       slow_writes({kind}))
        _wait_for_the_moment(child, kind, rng)
        child.kill()
        status = child.wait()
        log = child.output
        assert status == -signal.SIGKILL, log
        kills += 1
        assert "Traceback" not in log, log
        if newest is not None and "resuming from" in log:  # the resume took the newest checkpoint
            assert f"resuming from {out / f'checkpoint-{newest}.safetensors'} (step {newest})" in log, log
        _assert_intact(out)
    assert kills == len(kinds) >= 20

    final = Forked(run + ["--resume"], tmp_path / "final.log")
    assert final.wait() == 0, final.output
    resumed = rows(out)  # and no warning: no torn line is left
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{steps - 1}.safetensors",
                                                     f"checkpoint-{steps}.safetensors", "config.json", "data.json",
                                                     "metrics.jsonl"]


def nan_weight_after(step: int) -> Callable[[Callable[[bytes], None]], None]:
    """A child patch: after step `step`, a NaN in one weight (the step's loss and gradient norm still finite): the
    state diverged, and only the check of the weights before a checkpoint can tell."""

    def patch(notify: Callable[[bytes], None]) -> None:
        real_step, calls = TrainingStep.__call__, {"n": 0}

        def step_then_nan(self, *args, **kwargs):
            result = real_step(self, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] == step:
                self.model.embed.weight.data[3, 5] = float("nan")
            return result

        TrainingStep.__call__ = step_then_nan

    return patch


def test_a_diverging_run_never_checkpoints_non_finite_weights_and_resumes(tmp_path, text_file):
    """A run whose weights turn NaN after step 5 stops there in one line, naming the step and the newest checkpoint;
    every checkpoint left loads (finite), and a resume from it ends where an uninterrupted run does, loss for loss."""
    flags = ["--steps", "8", "--log-every", "1", "--ckpt-every", "1", "--keep-checkpoints", "2", "--eval-every", "0"]
    straight = Forked(argv(text_file, tmp_path / "straight", *flags), tmp_path / "straight.log")
    assert straight.wait() == 0, straight.output
    out = tmp_path / "run"
    child = Forked(argv(text_file, out, *flags), tmp_path / "diverged.log", nan_weight_after(5))
    assert child.wait() == 1
    log = child.output
    assert "Traceback" not in log, log
    assert error_line(log) == (f"error: the weights became non-finite at step 5 (embed.weight); stopping without a "
                               f"checkpoint of this step. Last good checkpoint: {out / 'checkpoint-4.safetensors'} "
                               "(step 4)")
    assert [step for step, _ in checkpoint_files.numbered(out)] == [4, 3]
    for step, path in checkpoint_files.numbered(out):
        assert checkpoint_files.load_file(path)["step"] == step  # finite: load_file checks
    resumed = Forked(argv(text_file, out, *flags, "--resume"), tmp_path / "resumed.log")
    assert resumed.wait() == 0, resumed.output
    assert f"resuming from {out / 'checkpoint-4.safetensors'} (step 4)" in resumed.output
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(tmp_path / "straight")]


def test_sigterm_and_sigusr1_checkpoint_the_step_reached(tmp_path, text_file):
    for signum, status in ((signal.SIGTERM, 143), (signal.SIGUSR1, 138)):
        out = tmp_path / signal.Signals(signum).name
        child = Forked(argv(text_file, out, "--steps", "1000", "--log-every", "1", "--ckpt-every", "1000",
                            "--eval-every", "0"), tmp_path / f"{out.name}.log", slow_writes({"metrics"}))
        assert child.wait_for(b"m")  # a row half written: the signal lands in the middle of a step
        child.kill(signum)
        assert child.wait() == status, child.output
        reached = rows(out)[-1]["step"]
        assert [p.name for p in out.iterdir() if p.suffix == ".safetensors"] == [f"checkpoint-{reached}.safetensors"]
        assert checkpoint_files.load_file(out / f"checkpoint-{reached}.safetensors")["step"] == reached
        name = signal.Signals(signum).name
        assert f"{name}: saving a checkpoint at the end of this step, then stopping" in child.output
        assert f"stopped at step {reached}; resume with --resume --out {out}" in child.output


def cuda_visible_but_never_started(notify: Callable[[bytes], None]) -> None:
    """A child patch: CUDA looks available, as on a GPU machine, and starting it fails."""

    def never(*a, **k):
        raise AssertionError("a run with --device cpu started CUDA")

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = torch.cuda.random.device_count = lambda: 1
    torch.cuda._lazy_init = torch.cuda.random._lazy_init = never


def test_a_run_on_the_cpu_never_starts_cuda(tmp_path, text_file):
    """On a GPU machine too, a --device cpu run (checkpoints, resume, signals) leaves CUDA alone: no GPU context per
    run, and a run forked from a process that started CUDA works. In a forked child, so that the patch stays there."""
    out = tmp_path / "run"
    child = Forked(argv(text_file, out, "--steps", "2", "--ckpt-every", "1"), tmp_path / "a.log",
                   cuda_visible_but_never_started)
    assert child.wait() == 0 and "Traceback" not in child.output, child.output
    child = Forked(argv(text_file, out, "--steps", "3", "--resume"), tmp_path / "b.log", cuda_visible_but_never_started)
    assert child.wait() == 0 and "Traceback" not in child.output, child.output
    assert checkpoint_files.load_file(out / "checkpoint-3.safetensors")["step"] == 3


# ------------------------------------------------------------------------------ one test per failure case


def main(args: list[str], capsys) -> tuple[int, str]:
    """train.main in this process: (exit status, stdout + stderr); a flag's error gives status 2."""
    try:
        code = train.main(args)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def error_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.slow  # train.py runs
def test_a_new_run_into_a_run_is_refused_and_a_failed_start_touches_nothing(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "2"), capsys)[0] == 0
    before = snapshot(out)
    code, output = main(argv(text_file, out, "--steps", "2"), capsys)
    assert code == 1 and error_line(output) == (
        f"error: {out} already holds a run (checkpoint-2.safetensors, metrics.jsonl); continue it with --resume, or "
        "start "
        f"over with --overwrite (moves it to {out}.old-<UTC time>)")
    code, output = main(argv(text_file, out, "--steps", "2", "--attn", "sdpa-flash"), capsys)
    assert code == 2 and "--attn sdpa-flash cannot run on cpu" in error_line(output)
    assert snapshot(out) == before
    code, output = main(argv(text_file, out, "--steps", "2", "--overwrite"), capsys)
    assert code == 0
    [old] = tmp_path.glob("run.old-*")
    assert f"--overwrite: moved the earlier run in {out} to {old}" in output
    assert snapshot(old).keys() == before.keys()


@pytest.mark.slow  # train.py runs
def test_a_locked_out_is_refused_and_nothing_changes(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "2"), capsys)[0] == 0
    holder = subprocess.Popen(["sleep", "60"])  # a live process of this host holds the lock
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "start": start}))
        before = snapshot(out)
        for extra in ([], ["--resume", "--steps", "4"], ["--overwrite"]):
            code, output = main(argv(text_file, out, "--steps", "2", *extra), capsys)
            assert code == 1 and error_line(output) == (
                f"error: {out} is in use by another run (process {holder.pid} on {socket.gethostname()}); wait for "
                "it to end, or choose another --out")
            assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    code, output = main(argv(text_file, out, "--steps", "4", "--resume"), capsys)  # its process is gone: stale
    assert code == 0 and f"{out}: removed the stale lock of process {holder.pid}, which no longer runs" in output


@pytest.mark.slow  # eight forked runs over the whole standard library
def test_sibling_runs_share_the_token_cache_safely(tmp_path):
    # The default corpus (the standard library, tens of MB): long enough to write that runs started together
    # overlap. With one shared temporary name, some of them failed ("No such file", "cannot mmap an empty file").
    for trial in range(2):
        children = [Forked([*T, "--out", str(tmp_path / f"{trial}" / f"run{i}"), "--steps", "1",
                            "--keep-checkpoints", "0", "--eval-every", "0"], tmp_path / f"{trial}-{i}.log")
                    for i in range(4)]
        for child in children:
            assert child.wait() == 0, child.output
        cache = sorted(p.name for p in (tmp_path / f"{trial}" / ".token_cache").iterdir())
        assert len(cache) == 1 and cache[0].startswith("stdlib-") and cache[0].endswith(".bin"), cache


def test_leftovers_of_a_killed_checkpoint_write_are_removed(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    child = Forked(argv(text_file, out, "--steps", "3", "--ckpt-every", "1"), tmp_path / "c.log",
                   slow_writes({"checkpoint"}))
    assert child.wait_for(b"c") and child.wait_for(b"c")  # in the middle of writing the second checkpoint
    child.kill()
    assert child.wait() == -signal.SIGKILL
    [leftover] = out.glob(".checkpoint-2.safetensors.tmp-*")
    code, output = main(argv(text_file, out, "--steps", "3", "--resume"), capsys)
    assert code == 0 and f"{out}: removed 1 temporary file left by an interrupted write" in output
    assert f"resuming from {out / 'checkpoint-1.safetensors'} (step 1)" in output
    assert not leftover.exists()


@pytest.mark.parametrize("damage", [pytest.param("truncated", marks=pytest.mark.slow), "random", "empty"])
def test_a_checkpoint_that_does_not_load_falls_back_to_the_one_before(tmp_path, text_file, capsys, damage):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "4", "--ckpt-every", "1"), capsys)[0] == 0
    newest = out / "checkpoint-4.safetensors"
    data = newest.read_bytes()
    newest.write_bytes({"truncated": data[: len(data) // 2], "random": random.Random(0).randbytes(len(data)),
                        "empty": b""}[damage])
    code, output = main(argv(text_file, out, "--steps", "6", "--resume"), capsys)
    assert code == 0 and "Traceback" not in output
    [warning] = [line for line in output.splitlines() if line.startswith("warning:")]
    assert warning.startswith(f"warning: checkpoint {newest} does not load (")
    assert f"resuming from {out / 'checkpoint-3.safetensors'} (step 3)" in output
    for _, path in checkpoint_files.numbered(out):  # checkpoint-5 and checkpoint-6
        path.write_bytes(b"")
    code, output = main(argv(text_file, out, "--steps", "8", "--resume"), capsys)
    assert code == 1 and error_line(output).startswith(
        f"error: no checkpoint in {out} loads: checkpoint-6.safetensors (")


@pytest.mark.slow  # train.py runs and resumes
def test_a_torn_last_metrics_line_is_ignored_with_a_warning(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "4", "--log-every", "1"), capsys)[0] == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    code, output = main(argv(text_file, out, "--steps", "6", "--log-every", "1", "--resume"), capsys)
    assert code == 0
    assert f"warning: {out / 'metrics.jsonl'}: ignoring its torn last line (an interrupted write)" in output
    assert [r["step"] for r in rows(out)] == list(range(1, 7))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_stops_with_one_line_after_a_checkpoint(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    code, output = main(argv(text_file, out, "--steps", "10", "--log-every", "3", "--ckpt-every", "100"), capsys)
    assert code == 1 and "Traceback" not in output
    # The first step logs at once (no warm-up on the CPU): its row is the first write that fails.
    assert error_line(output) == (
        f"error: cannot write {out / 'metrics.jsonl'}: No space left on device; saved a checkpoint at step 1 first: "
        f"resume with --resume --out {out} once there is room")
    assert checkpoint_files.load_file(out / "checkpoint-1.safetensors")["step"] == 1


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path, text_file, capsys, monkeypatch):
    real_loss, calls = TrainingStep.loss, {"n": 0}

    def loss_then_two_ctrl_c(*a):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*a)

    monkeypatch.setattr(TrainingStep, "loss", loss_then_two_ctrl_c)
    out = tmp_path / "run"
    code, output = main(argv(text_file, out, "--steps", "10", "--ckpt-every", "1"), capsys)
    assert code == 130 and "Traceback" not in output
    assert output.splitlines()[-1] == (f"second Ctrl-C: stopped at once, without a checkpoint of this step; the "
                                       f"last checkpoint is {out / 'checkpoint-2.safetensors'}")
    assert not (out / LOCK_NAME).exists()


def test_resume_of_a_finished_run_or_below_its_step_says_so(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "4"), capsys)[0] == 0
    code, output = main(argv(text_file, out, "--steps", "4", "--resume"), capsys)
    assert code == 0 and "Traceback" not in output
    lines = output.splitlines()
    assert lines[-5:-3] == [f"nothing to do: {out / 'checkpoint-4.safetensors'} is at step 4, which is --steps 4; "
                            "pass a larger "
                            "--steps to train on", "done: step 4 of 4 in 0.0 s"]
    assert lines[-3] == f"checkpoint: {out / 'checkpoint-4.safetensors'}"
    assert lines[-1].endswith(f"--out {out} --steps 8")
    code, output = main(argv(text_file, out, "--steps", "3", "--resume"), capsys)
    assert code == 1 and error_line(output) == (
        f"error: --steps 3 is below the step of {out / 'checkpoint-4.safetensors'} (4); pass --steps 4 or more")


@pytest.mark.slow  # train.py runs and resumes
def test_resume_with_another_attention_backend_works_and_says_so(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(argv(text_file, out, "--steps", "2", "--attn", "sdpa"), capsys)[0] == 0
    code, output = main(argv(text_file, out, "--steps", "3", "--attn", "naive", "--resume"), capsys)
    assert code == 0, output
    assert ("resuming with --attn naive; the checkpoint was written with sdpa (the weights do not depend on it)"
            in output)
    assert checkpoint_files.load_file(out / "checkpoint-3.safetensors")["config"]["execution"]["attn"] == "naive"


def test_text_that_is_not_utf8_is_named(tmp_path, capsys):
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("some text\n" * 1000, encoding="utf-16")
    code, output = main([*T, "--data", str(utf16), "--out", str(tmp_path / "a")], capsys)
    assert code == 1 and error_line(output).startswith(f"error: --data {utf16} is UTF-16 text, not UTF-8")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    code, output = main([*T, "--data", str(binary), "--out", str(tmp_path / "b")], capsys)
    assert code == 1 and error_line(output) == f"error: --data {binary} is binary, not text (it holds NUL bytes)"
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text, long enough to train on. " * 400)
    (folder / "b.txt").write_text("more text\n", encoding="utf-16")
    code, output = main([*T, "--data", str(folder), "--out", str(tmp_path / "c"), "--steps", "1"], capsys)
    assert code == 0
    assert (f"warning: --data {folder}: skipping {folder / 'b.txt'}, which is UTF-16 text, not UTF-8") in output


def test_token_files_with_ids_out_of_range_or_an_odd_size(tmp_path, capsys):
    negative = tmp_path / "ids.npy"
    ids = np.arange(10_000) % 300
    ids[777] = -1
    np.save(negative, ids)
    code, output = main([*T, "--data", str(negative), "--out", str(tmp_path / "a"), "--vocab-size", "300"], capsys)
    assert code == 1 and error_line(output) == (
        f"error: token array {negative} holds token id -1 (the first negative one at position 777); ids must be "
        "in [0, 300)")
    odd = tmp_path / "ids.bin"
    odd.write_bytes(b"\1" * 20_001)
    code, output = main([*T, "--data", str(odd), "--out", str(tmp_path / "b")], capsys)
    assert code == 1 and error_line(output) == (
        f"error: --data {odd} has an odd number of bytes (20,001): a .bin token file holds uint16 ids of 2 bytes "
        "each (a text file should not end in .bin)")


def test_out_that_is_a_file_or_not_writable(tmp_path, text_file, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, output = main(argv(text_file, a_file), capsys)
    assert code == 1 and error_line(output) == f"error: --out {a_file} is a file, not a directory"
    if os.geteuid() == 0:  # permissions do not stop root; sysfs does
        readonly, reason = Path("/sys/flash-lm-run"), "Operation not permitted"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        readonly, reason = tmp_path / "ro" / "run", "Permission denied"
    code, output = main(argv(text_file, readonly), capsys)
    assert code == 1 and error_line(output).startswith(f"error: --out {readonly} cannot be created: {reason}")


@pytest.mark.parametrize("flags, message", [
    (["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
    (["--ckpt-every", "-3"], "--ckpt-every must be >= 0, got -3"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0, got -1"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be >= 0, got -1"),
    (["--resume", "--overwrite"], "--resume continues the run in --out and --overwrite moves it aside"),
])
def test_negative_and_contradictory_flags_are_refused(tmp_path, text_file, capsys, flags, message):
    code, output = main(argv(text_file, tmp_path / "run", *flags), capsys)
    assert code == 2 and message in output and not (tmp_path / "run").exists()


def test_a_warm_up_longer_than_the_run_is_named(tmp_path, text_file, capsys):
    code, output = main(argv(text_file, tmp_path / "run", "--steps", "2", "--warmup-steps", "5"), capsys)
    assert code == 0 and ("warning: --warmup-steps 5 is not shorter than the run (--steps 2): the learning rate "
                          "never reaches --lr 0.0006") in output


@pytest.mark.parametrize("attn, reason", [("flex", "FlexAttention has no backward on the CPU"),
                                          ("sdpa-cudnn", "needs a CUDA GPU")])
def test_a_backend_that_cannot_run_is_refused_before_the_model_is_built(tmp_path, text_file, capsys, monkeypatch,
                                                                        attn, reason):
    if torch.cuda.is_available():
        pytest.skip("the backends can run here")

    def never(*a, **k):
        raise AssertionError("built or loaded before the backend was checked")

    monkeypatch.setattr(trainer, "TransformerLM", never)
    monkeypatch.setattr(trainer, "open_source", never)
    code, output = main(argv(text_file, tmp_path / "run", "--attn", attn), capsys)
    assert code == 2 and error_line(output).startswith(f"error: --attn {attn} cannot run on cpu with float32 for "
                                                       f"training: {reason}")
    assert not (tmp_path / "run").exists()
