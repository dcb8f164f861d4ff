import random

import numpy as np
import pytest
import safetensors.torch
import torch

from tests.checkpoints import flip_bytes, legacy_rng_state
from training.checkpoint import files as ckpt
from training.checkpoint.files import CheckpointError


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((4,), float(step))}


def test_keeps_the_last_k_and_removes_the_legacy_file_once_k_exist(tmp_path):
    torch.save(state(3), tmp_path / "checkpoint.pt")
    ckpt.save(state(4), tmp_path, 4, keep=2)
    assert names(tmp_path) == ["checkpoint-4.safetensors", "checkpoint.pt"]
    for step in (5, 6, 7):
        assert ckpt.save(state(step), tmp_path, step, keep=2) == tmp_path / f"checkpoint-{step}.safetensors"
    assert names(tmp_path) == ["checkpoint-6.safetensors", "checkpoint-7.safetensors"]
    assert ckpt.load_file(tmp_path / "checkpoint-7.safetensors")["step"] == 7
    ckpt.save(state(8), tmp_path, 8, keep=1)
    assert names(tmp_path) == ["checkpoint-8.safetensors"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.save(state(9), tmp_path, 9, keep=0)


def test_checkpoints_past_the_step_written_are_an_abandoned_timeline(tmp_path):
    for step in (5, 6, 9):
        ckpt.save(state(step), tmp_path, step, keep=5)
    torch.save(state(8), tmp_path / "checkpoint-8.pt")  # an earlier version's, past the step too
    ckpt.save(state(7), tmp_path, 7, keep=5)  # resumed from 6 because 9 did not load
    assert names(tmp_path) == ["checkpoint-5.safetensors", "checkpoint-6.safetensors", "checkpoint-7.safetensors"]


def test_earlier_versions_numbered_files_count_among_the_kept(tmp_path):
    for step in (2, 3):
        torch.save(state(step), tmp_path / f"checkpoint-{step}.pt")
    ckpt.save(state(3), tmp_path, 3, keep=2)
    assert [p.name for p in ckpt.candidates(tmp_path)] == ["checkpoint-3.safetensors", "checkpoint-3.pt"]
    ckpt.save(state(4), tmp_path, 4, keep=2)
    assert names(tmp_path) == ["checkpoint-3.safetensors", "checkpoint-4.safetensors"]


def test_a_failed_write_leaves_the_earlier_checkpoints_and_no_temporary_file(tmp_path, monkeypatch):
    ckpt.save(state(1), tmp_path, 1, keep=2)

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(state(2), tmp_path, 2, keep=2)
    assert names(tmp_path) == ["checkpoint-1.safetensors"]


def model_state(step: int) -> dict:
    return {"step": step, "model": {"embed.weight": torch.full((64,), float(step)), "norm.weight": torch.ones(4)}}


def nan_weights(path):
    bad = model_state(5)
    bad["model"]["norm.weight"][1] = float("nan")
    ckpt.format.save(bad, path)


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "SafetensorError: "),
    (lambda p: p.write_bytes(b""), "the file is empty"),
    (lambda p: p.write_bytes(random.Random(0).randbytes(p.stat().st_size)), "SafetensorError: "),
    (lambda p: p.write_bytes(b"hello"), "SafetensorError: "),
    (lambda p: flip_bytes(p, "/model/embed.weight"), "tensor model/embed.weight does not match its checksum (the "
                                                     "file is damaged)"),
    (nan_weights, "its weights are not finite (norm.weight)"),
], ids=["truncated", "empty", "random", "text", "flipped-bytes", "nan-weights"])
def test_resume_falls_back_past_a_checkpoint_that_does_not_load(tmp_path, damage, reason):
    for step in (4, 5):
        ckpt.save(model_state(step), tmp_path, step, keep=2)
    newest = tmp_path / "checkpoint-5.safetensors"
    damage(newest)
    warnings = []
    path, loaded = ckpt.load_newest(tmp_path, warnings.append)
    assert path == tmp_path / "checkpoint-4.safetensors" and loaded["step"] == 4
    [line] = warnings
    assert line.startswith(f"warning: checkpoint {newest} does not load (") and "\n" not in line
    assert line.endswith("); trying an older one") and reason in line


def test_legacy_checkpoint_is_the_oldest_candidate(tmp_path):
    torch.save(state(3), tmp_path / "checkpoint.pt")
    assert ckpt.load_newest(tmp_path)[1]["step"] == 3
    ckpt.save(state(4), tmp_path, 4, keep=2)
    assert ckpt.candidates(tmp_path) == [tmp_path / "checkpoint-4.safetensors", tmp_path / "checkpoint.pt"]
    assert ckpt.load_newest(tmp_path)[0] == tmp_path / "checkpoint-4.safetensors"


def test_an_earlier_version_s_pickled_checkpoint_loads_only_with_allow_pickle(tmp_path):
    """Its NumPy RNG state does not unpickle safely: without allow_pickle it is skipped with a warning naming the
    flag, and the older one that loads is taken; with it, it is the newest."""
    ckpt.save(model_state(2), tmp_path, 2, keep=2)
    torch.save({**model_state(3), "rng": legacy_rng_state()}, tmp_path / "checkpoint-3.pt")
    warnings = []
    path, loaded = ckpt.load_newest(tmp_path, warnings.append)
    assert path == tmp_path / "checkpoint-2.safetensors" and loaded["step"] == 2
    assert warnings == [f"warning: checkpoint {tmp_path / 'checkpoint-3.pt'} does not load (written by an earlier "
                        "version with pickle, which can run code when loaded; pass --allow-pickle if you trust this "
                        "file); trying an older one"]
    path, loaded = ckpt.load_newest(tmp_path, lambda m: pytest.fail(m), allow_pickle=True)
    assert path == tmp_path / "checkpoint-3.pt" and loaded["step"] == 3
    assert isinstance(loaded["rng"]["numpy"], tuple) and isinstance(loaded["rng"]["numpy"][1], np.ndarray)
    with pytest.raises(CheckpointError, match=f"^checkpoint {tmp_path / 'checkpoint-3.pt'} does not load: written by "
                                              "an earlier version with pickle, .*pass --allow-pickle if you trust "
                                              "this file$"):
        ckpt.load_named(tmp_path / "checkpoint-3.pt")
    assert ckpt.load_named(tmp_path / "checkpoint-3.pt", allow_pickle=True)["step"] == 3


def test_an_earlier_version_s_checkpoint_with_weights_that_are_not_finite_does_not_load(tmp_path):
    bad = model_state(3)
    bad["model"]["embed.weight"][0] = float("inf")
    torch.save(bad, tmp_path / "checkpoint-3.pt")
    with pytest.raises(CheckpointError, match=r"does not load: its weights are not finite \(embed.weight\)$"):
        ckpt.load_named(tmp_path / "checkpoint-3.pt", allow_pickle=True)


def test_no_checkpoint_or_none_that_loads_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^no checkpoint to resume from in {tmp_path} \(looked for "):
        ckpt.load_newest(tmp_path)
    (tmp_path / "checkpoint-2.safetensors").write_bytes(b"")
    torch.save({"weights": 1}, tmp_path / "checkpoint.pt")  # loads, but is not one of ours
    warnings = []
    with pytest.raises(CheckpointError) as e:
        ckpt.load_newest(tmp_path, warnings.append)
    assert str(e.value) == (f"no checkpoint in {tmp_path} loads: checkpoint-2.safetensors (the file is empty); "
                            "checkpoint.pt (not a checkpoint of this trainer (no step))")
    assert len(warnings) == 1  # the last one is named in the error, not warned about first


def test_a_checkpoint_given_by_name_that_does_not_load_is_one_line(tmp_path):
    empty, junk = tmp_path / "empty.safetensors", tmp_path / "junk.safetensors"
    empty.write_bytes(b"")
    junk.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match=f"^checkpoint {empty} does not load: the file is empty$"):
        ckpt.load_named(empty)
    with pytest.raises(ckpt.CheckpointError, match=f"^checkpoint {junk} does not load: SafetensorError: Error while "
                                                   "deserializing header"):
        ckpt.load_named(junk)
    old = tmp_path / "junk.pt"  # any other name is read as an earlier version's pickle
    old.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match=f"^checkpoint {old} does not load: UnpicklingError"):
        ckpt.load_named(old)
