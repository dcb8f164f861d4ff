import random

import pytest
import torch

from training.checkpoint import files as ckpt
from training.checkpoint.files import CheckpointError


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((4,), float(step))}


def test_keeps_the_last_k_and_removes_the_legacy_file_once_k_exist(tmp_path):
    torch.save(state(3), tmp_path / "checkpoint.pt")
    ckpt.save(state(4), tmp_path, 4, keep=2)
    assert names(tmp_path) == ["checkpoint-4.pt", "checkpoint.pt"]
    for step in (5, 6, 7):
        assert ckpt.save(state(step), tmp_path, step, keep=2) == tmp_path / f"checkpoint-{step}.pt"
    assert names(tmp_path) == ["checkpoint-6.pt", "checkpoint-7.pt"]
    assert ckpt.load_file(tmp_path / "checkpoint-7.pt")["step"] == 7
    ckpt.save(state(8), tmp_path, 8, keep=1)
    assert names(tmp_path) == ["checkpoint-8.pt"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.save(state(9), tmp_path, 9, keep=0)


def test_checkpoints_past_the_step_written_are_an_abandoned_timeline(tmp_path):
    for step in (5, 6, 9):
        ckpt.save(state(step), tmp_path, step, keep=5)
    ckpt.save(state(7), tmp_path, 7, keep=5)  # resumed from 6 because 9 did not load
    assert names(tmp_path) == ["checkpoint-5.pt", "checkpoint-6.pt", "checkpoint-7.pt"]


def test_a_failed_write_leaves_the_earlier_checkpoints_and_no_temporary_file(tmp_path, monkeypatch):
    ckpt.save(state(1), tmp_path, 1, keep=2)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(state(2), tmp_path, 2, keep=2)
    assert names(tmp_path) == ["checkpoint-1.pt"]


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[: len(b) // 2], "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
                                 "central directory"),
    (lambda b: b"", "the file is empty"),
    (lambda b: random.Random(0).randbytes(len(b)), ""),
    (lambda b: b"hello", ""),
], ids=["truncated", "empty", "random", "text"])
def test_resume_falls_back_past_a_checkpoint_that_does_not_load(tmp_path, damage, reason):
    for step in (4, 5):
        ckpt.save(state(step), tmp_path, step, keep=2)
    newest = tmp_path / "checkpoint-5.pt"
    newest.write_bytes(damage(newest.read_bytes()))
    warnings = []
    path, loaded = ckpt.load_newest(tmp_path, warnings.append)
    assert path == tmp_path / "checkpoint-4.pt" and loaded["step"] == 4
    [line] = warnings
    assert line.startswith(f"warning: checkpoint {newest} does not load (") and "\n" not in line
    assert line.endswith("); trying an older one") and reason in line


def test_legacy_checkpoint_is_the_oldest_candidate(tmp_path):
    torch.save(state(3), tmp_path / "checkpoint.pt")
    assert ckpt.load_newest(tmp_path)[1]["step"] == 3
    ckpt.save(state(4), tmp_path, 4, keep=2)
    assert ckpt.candidates(tmp_path) == [tmp_path / "checkpoint-4.pt", tmp_path / "checkpoint.pt"]
    assert ckpt.load_newest(tmp_path)[0] == tmp_path / "checkpoint-4.pt"


def test_no_checkpoint_or_none_that_loads_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^no checkpoint to resume from in {tmp_path} \(looked for "):
        ckpt.load_newest(tmp_path)
    (tmp_path / "checkpoint-2.pt").write_bytes(b"")
    torch.save({"weights": 1}, tmp_path / "checkpoint.pt")  # loads, but is not one of ours
    warnings = []
    with pytest.raises(CheckpointError) as e:
        ckpt.load_newest(tmp_path, warnings.append)
    assert str(e.value) == (f"no checkpoint in {tmp_path} loads: checkpoint-2.pt (the file is empty); "
                            "checkpoint.pt (ValueError: not a checkpoint of this trainer (no step))")
    assert len(warnings) == 1  # the last one is named in the error, not warned about first


def test_a_checkpoint_given_by_name_that_does_not_load_is_one_line(tmp_path):
    empty, junk = tmp_path / "empty.pt", tmp_path / "junk.pt"
    empty.write_bytes(b"")
    junk.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match=f"^checkpoint {empty} does not load: the file is empty$"):
        ckpt.load_named(empty)
    with pytest.raises(ckpt.CheckpointError, match=f"^checkpoint {junk} does not load: UnpicklingError"):
        ckpt.load_named(junk)
