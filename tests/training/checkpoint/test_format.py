import pytest
import torch

from training.checkpoint import format as checkpoint


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    checkpoint.save_atomic({"step": 1, "w": torch.randn(3)}, path)

    def crash(obj, f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic({"step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1  # the last good checkpoint survives
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind


def test_rng_state_round_trip():
    state = checkpoint.rng_state()
    a = torch.rand(3)
    checkpoint.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3), a)


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from at .*x.pt"):
        checkpoint.load(tmp_path / "x.pt")
