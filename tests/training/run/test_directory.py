import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from training.run import directory as run_dir
from training.parallel.distributed import DistContext
from training.run.directory import LOCK_NAME, RunDirError, RunLock


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_lock(out: Path, **holder) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    path.write_text(json.dumps(holder) + "\n")
    return path


def test_lock_names_its_holder_stops_a_second_run_and_is_freed(tmp_path):
    messages = []
    first = RunLock(tmp_path, messages.append)
    first.acquire()
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    with pytest.raises(RunDirError, match=rf"{tmp_path} is in use by another run \(process {os.getpid()} on "):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists() and messages == []


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, host=socket.gethostname(), pid=pid, start=None)
    messages = []
    with RunLock(tmp_path, messages.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert messages == [f"{tmp_path}: removed the stale lock of process {pid}, which no longer runs"]
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing left: no moved-aside lock either


def test_a_reused_pid_does_not_hold_the_lock(tmp_path):
    # Our own pid, but a start time that is not ours: the process that wrote the lock died and its pid was reused.
    write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), start="1")
    messages = []
    with RunLock(tmp_path, messages.append):
        pass
    assert messages == [f"{tmp_path}: removed the stale lock of process {os.getpid()}, which no longer runs"]


def test_lock_of_another_host_names_the_file_to_delete(tmp_path):
    path = write_lock(tmp_path, host="other-host.example", pid=1234, start=None)
    with pytest.raises(RunDirError, match=rf"in use by process 1234 on host other-host.example, which cannot be "
                                          rf"checked from here; if that run is gone, delete {path}"):
        RunLock(tmp_path).acquire()
    assert path.exists()


def test_unreadable_lock_is_taken_over_with_a_message(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")  # a run never leaves one: its lock appears complete or not at all
    messages = []
    with RunLock(tmp_path, messages.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert messages == [f"{tmp_path}: removed an unreadable lock"]


def _die_while_taking_the_lock(out: Path, moment: str) -> None:
    """In a forked child: acquire the lock of `out` and die with os._exit (no cleanup, as under SIGKILL) half-way
    through writing it, or just before linking it into place."""
    def torn_write(fd: int) -> None:
        os.ftruncate(fd, 5)
        os._exit(9)

    pid = os.fork()
    if pid == 0:
        if moment == "writing":
            run_dir.os.fsync = torn_write
        else:
            run_dir.os.link = lambda *args: os._exit(9)
        try:
            RunLock(out).acquire()
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 9


@pytest.mark.parametrize("moment", ["writing", "linking"])
def test_a_run_killed_while_taking_the_lock_leaves_no_lock(tmp_path, moment):
    """At most a temporary file is left; the next run takes the lock at once and removes that file."""
    _die_while_taking_the_lock(tmp_path, moment)
    assert not (tmp_path / LOCK_NAME).exists()
    messages = []
    lock = run_dir.claim(tmp_path, resume=False, overwrite=False, say=messages.append)
    run_dir.prepare(tmp_path, overwrite=False, say=messages.append)
    lock.release()
    assert [p.name for p in tmp_path.iterdir()] == []
    assert len(messages) == 1 and messages[0].startswith(f"{tmp_path}: removed 1 temporary file left by an "), messages


def _take(out: str, start, results) -> None:
    start.wait()
    try:
        lock = RunLock(Path(out), lambda m: None)
        lock.acquire()
        results.put("took")
        time.sleep(1.0)  # hold it while the others try
        lock.release()
    except RunDirError:
        results.put("refused")


def test_processes_racing_for_a_stale_lock_let_exactly_one_in(tmp_path):
    write_lock(tmp_path, host=socket.gethostname(), pid=dead_pid(), start=None)
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(str(tmp_path), start, results)) for _ in range(6)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    assert outcomes == ["refused"] * 5 + ["took"]


def test_out_that_is_a_file_or_cannot_be_written(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=rf"^--out {tmp_path}/f is a file, not a directory$"):
        run_dir.check_out(tmp_path / "f")
    with pytest.raises(RunDirError, match=rf"^--out {tmp_path}/f/run cannot be created: {tmp_path}/f is a file"):
        run_dir.check_out(tmp_path / "f" / "run")
    if os.geteuid() == 0:  # root writes anywhere that permissions guard; sysfs refuses even root
        readonly = Path("/sys/flash-lm-run")
        with pytest.raises(RunDirError, match=r"^--out /sys/flash-lm-run cannot be created: Operation not permitted"):
            run_dir.check_out(readonly)
    else:
        readonly = tmp_path / "ro"
        readonly.mkdir(mode=0o555)
        with pytest.raises(RunDirError, match=rf"^--out {readonly}/run cannot be created: Permission denied"):
            run_dir.check_out(readonly / "run")
        with pytest.raises(RunDirError, match=rf"^--out {readonly} is not writable"):
            run_dir.check_out(readonly)
    run_dir.check_out(tmp_path / "new" / "run")
    assert (tmp_path / "new" / "run").is_dir()


def test_a_new_run_into_a_run_names_resume_and_overwrite(tmp_path):
    run_dir.check_new_run(tmp_path, resume=False, overwrite=False)  # empty: fine
    (tmp_path / "metrics.jsonl").write_text("")  # a run that wrote nothing: nothing to lose
    run_dir.check_new_run(tmp_path, resume=False, overwrite=False)
    (tmp_path / "checkpoint-20.safetensors").write_bytes(b"x")
    with pytest.raises(RunDirError, match=r"already holds a run \(checkpoint-20.safetensors\); continue it with"):
        run_dir.check_new_run(tmp_path, resume=False, overwrite=False)  # a checkpoint alone is a run
    (tmp_path / "checkpoint-20.pt").write_bytes(b"x")  # and an earlier version's
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError) as e:
        run_dir.check_new_run(tmp_path, resume=False, overwrite=False)
    assert str(e.value) == (f"{tmp_path} already holds a run (checkpoint-20.pt, checkpoint-20.safetensors, "
                            "metrics.jsonl); continue it with --resume, or start over with --overwrite (moves it to "
                            f"{tmp_path}.old-<UTC time>)")
    run_dir.check_new_run(tmp_path, resume=True, overwrite=False)
    run_dir.check_new_run(tmp_path, resume=False, overwrite=True)


def test_claim_refusing_a_run_leaves_no_lock(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(RunDirError, match="already holds a run"):
        run_dir.claim(tmp_path, resume=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    lock = run_dir.claim(tmp_path, resume=True, overwrite=False)
    assert lock.held and (tmp_path / LOCK_NAME).exists()
    lock.release()


def test_overwrite_moves_the_run_aside_and_keeps_the_lock(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint-5.safetensors", "metrics.jsonl"):
        (out / name).write_text(name)
    (out / "wandb").mkdir()
    messages = []
    with run_dir.claim(out, resume=False, overwrite=True, say=messages.append):
        run_dir.prepare(out, overwrite=True, say=messages.append)
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    [old] = tmp_path.glob("run.old-*")
    assert sorted(p.name for p in old.iterdir()) == ["checkpoint-5.safetensors", "metrics.jsonl", "wandb"]
    assert (old / "metrics.jsonl").read_text() == "metrics.jsonl"
    assert messages == [f"--overwrite: moved the earlier run in {out} to {old}"]
    stamp = datetime.strptime(old.name.removeprefix("run.old-"), "%Y%m%d-%H%M%S").replace(tzinfo=timezone.utc)
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60


def test_move_aside_never_reuses_a_name(tmp_path):
    out = tmp_path / "run"
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    for expected, name in (("run.old-20260102-030405", "checkpoint-1.safetensors"),
                           ("run.old-20260102-030405-2", "checkpoint-1.pt")):
        out.mkdir(exist_ok=True)
        (out / name).write_text("x")
        assert run_dir.move_aside(out, now).name == expected
    assert run_dir.move_aside(out, now) is None  # no run left to move


def test_prepare_removes_leftovers_of_killed_writes(tmp_path):
    (tmp_path / ".checkpoint-5.safetensors.tmp-123-abcd").write_bytes(b"\0" * 2**20)
    (tmp_path / ".metrics.jsonl.tmp-99-0000").write_text("{}")
    (tmp_path / "checkpoint-4.safetensors").write_text("kept")
    messages = []
    run_dir.prepare(tmp_path, overwrite=False, say=messages.append)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-4.safetensors"]
    assert messages == [f"{tmp_path}: removed 2 temporary files left by an interrupted write (1.0 MiB)"]


def test_owned_holds_the_lock_for_the_run_and_releases_it_whatever_happens(tmp_path):
    out = tmp_path / "run"
    with run_dir.owned(out, resume=False, overwrite=False, ctx=DistContext()):
        assert out.is_dir() and json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirError, match=rf"{out} is in use by another run \(process {os.getpid()} on "):
            with run_dir.owned(out, resume=True, overwrite=False, ctx=DistContext()):
                pass
        assert (out / LOCK_NAME).exists(), "the refused second owner leaves the first one's lock"
    assert not (out / LOCK_NAME).exists()
    assert not out.exists(), "a run that wrote nothing leaves no directory it created"
    with pytest.raises(KeyError):  # a run that fails: the lock goes all the same
        with run_dir.owned(out, resume=False, overwrite=False, ctx=DistContext()):
            raise KeyError("boom")
    assert not out.exists()
    out.mkdir()  # a directory it did not create stays, empty or not
    with run_dir.owned(out, resume=False, overwrite=False, ctx=DistContext()):
        pass
    assert list(out.iterdir()) == []
    with run_dir.owned(tmp_path / "written", resume=False, overwrite=False, ctx=DistContext()):
        (tmp_path / "written" / "config.json").write_text("{}")
    assert [p.name for p in (tmp_path / "written").iterdir()] == ["config.json"]
    with pytest.raises(KeyError):  # the parents it created go too, unless something else was written there
        with run_dir.owned(tmp_path / "a" / "b" / "run", resume=False, overwrite=False, ctx=DistContext()):
            raise KeyError("boom")
    assert not (tmp_path / "a").exists()
    with pytest.raises(KeyError):
        with run_dir.owned(tmp_path / "a" / "b" / "run", resume=False, overwrite=False, ctx=DistContext()):
            (tmp_path / "a" / ".token_cache").mkdir()
            raise KeyError("boom")
    assert [p.name for p in (tmp_path / "a").iterdir()] == [".token_cache"]


def test_owned_refuses_a_new_run_into_a_run_and_takes_no_lock(tmp_path):
    (tmp_path / "checkpoint-3.safetensors").write_bytes(b"x")
    with pytest.raises(RunDirError, match="already holds a run \\(checkpoint-3.safetensors\\); continue it with "
                                          "--resume"):
        with run_dir.owned(tmp_path, resume=False, overwrite=False, ctx=DistContext()):
            pytest.fail("the body must not run")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3.safetensors"]
    with run_dir.owned(tmp_path, resume=True, overwrite=False, ctx=DistContext()):
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()
