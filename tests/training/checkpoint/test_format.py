"""training/checkpoint/format.py: the safetensors checkpoint file, its checksums and finite weights, and the pickled
files of earlier versions, read only with allow_pickle."""

import json
import random

import numpy as np
import pytest
import safetensors.torch
import torch

from tests.checkpoints import MARKER, crafted_pickle, flip_bytes
from training.checkpoint import format as checkpoint
from training.checkpoint.format import CheckpointFormatError


def state(step: int = 1) -> dict:
    return {"step": step, "model": {"embed.weight": torch.randn(8, 4), "norm.weight": torch.ones(4)},
            "optimizer": {"state": {"embed.weight": {"step": 3.0, "exp_avg": torch.zeros(8, 4)}},
                          "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.95], "params": ["embed.weight"]}]},
            "scaler": {}, "rng": checkpoint.rng_state(), "config": {"model": {"d_model": 4}}}


def test_save_then_load_gives_the_state_back(tmp_path):
    saved = state(7)
    path = tmp_path / "ck.safetensors"
    checkpoint.save(saved, path)
    loaded = checkpoint.load(path)
    assert loaded.keys() == saved.keys() and loaded["step"] == 7 and loaded["config"] == saved["config"]
    for name, t in saved["model"].items():
        assert torch.equal(loaded["model"][name], t)
    assert loaded["optimizer"]["state"]["embed.weight"]["step"] == 3.0
    assert torch.equal(loaded["optimizer"]["state"]["embed.weight"]["exp_avg"], torch.zeros(8, 4))
    assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "ck.safetensors"
    checkpoint.save(state(1), path)

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(state(2), path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1  # the last good checkpoint survives
    assert [p.name for p in tmp_path.iterdir()] == ["ck.safetensors"]  # no temporary left behind


def test_rng_state_round_trip_through_the_file(tmp_path):
    checkpoint.save({"step": 1, "rng": checkpoint.rng_state()}, tmp_path / "ck.safetensors")
    a, b, c = torch.rand(3), np.random.rand(2), random.random()
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "ck.safetensors")["rng"])
    torch.testing.assert_close(torch.rand(3), a)
    assert np.array_equal(np.random.rand(2), b) and random.random() == c


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'x.safetensors'}"):
        checkpoint.load(tmp_path / "x.safetensors")


def test_only_tensors_and_json_values_are_saved(tmp_path):
    with pytest.raises(TypeError, match=r"not ndarray \(at /rng/numpy\)"):
        checkpoint.save({"step": 1, "rng": {"numpy": np.zeros(3)}}, tmp_path / "ck.safetensors")
    assert not list(tmp_path.iterdir())


def test_flipped_bytes_in_a_tensor_are_named_at_load(tmp_path):
    path = tmp_path / "ck.safetensors"
    checkpoint.save(state(), path)
    flip_bytes(path, "/model/embed.weight")
    with pytest.raises(CheckpointFormatError) as e:
        checkpoint.load(path)
    assert str(e.value) == "tensor model/embed.weight does not match its checksum (the file is damaged)"
    checkpoint.save(state(), path)
    flip_bytes(path, "/optimizer/state/embed.weight/exp_avg")
    with pytest.raises(CheckpointFormatError, match="^tensor optimizer/state/embed.weight/exp_avg does not match"):
        checkpoint.load(path)


def test_weights_that_are_not_finite_do_not_load(tmp_path):
    for bad in (float("nan"), float("inf")):
        saved = state()
        saved["model"]["norm.weight"][2] = bad
        checkpoint.save(saved, tmp_path / "ck.safetensors")  # the file is whole: its checksums hold
        with pytest.raises(CheckpointFormatError, match=r"^its weights are not finite \(norm.weight\)$"):
            checkpoint.load(tmp_path / "ck.safetensors")


def test_a_file_of_another_program_or_format_is_named(tmp_path):
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"^not a checkpoint of this trainer \(no flash_lm header\)$"):
        checkpoint.load(tmp_path / "other.safetensors")
    meta = {"format": "flash-lm checkpoint 9", "state": {}, "checksums": {}}
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "newer.safetensors"),
                                metadata={checkpoint.META_KEY: json.dumps(meta)})
    with pytest.raises(CheckpointFormatError, match="written in format 'flash-lm checkpoint 9', this version reads"):
        checkpoint.load(tmp_path / "newer.safetensors")


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / MARKER
    crafted_pickle(tmp_path / "checkpoint-3.pt", marker)
    with pytest.raises(CheckpointFormatError, match="pass --allow-pickle if you trust this file$"):
        checkpoint.load_legacy(tmp_path / "checkpoint-3.pt", allow_pickle=False)
    assert not marker.exists()
    # The file is indeed harmful: unpickled without restriction, it runs its code.
    checkpoint.load_legacy(tmp_path / "checkpoint-3.pt", allow_pickle=True)
    assert marker.exists()


def test_an_earlier_version_s_checkpoint_needs_allow_pickle_for_its_numpy_rng_state(tmp_path):
    path = tmp_path / "checkpoint-2.pt"
    torch.save({"step": 2, "model": {"w": torch.ones(2)}, "rng": {"numpy": np.random.get_state(),
                                                                   "python": random.getstate()}}, path)
    with pytest.raises(CheckpointFormatError, match="^written by an earlier version with pickle, which can run code "
                                                    "when loaded; pass --allow-pickle if you trust this file$"):
        checkpoint.load_legacy(path, allow_pickle=False)
    loaded = checkpoint.load_legacy(path, allow_pickle=True)
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["w"], torch.ones(2))
    # Tensors and plain values alone unpickle safely, without the flag.
    torch.save({"step": 4, "model": {"w": torch.ones(2)}}, path)
    assert checkpoint.load_legacy(path, allow_pickle=False)["step"] == 4
