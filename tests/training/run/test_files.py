import pytest

from training.run.files import is_temp, remove_leftovers, temp_path, write_atomic


def test_temporary_names_are_unique_hidden_and_recognised(tmp_path):
    target = tmp_path / "checkpoint-3.safetensors"
    names = {temp_path(target).name for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith(".checkpoint-3.safetensors.tmp-") and is_temp(tmp_path / n) for n in names)
    assert not is_temp(target) and not is_temp(tmp_path / ".lock")


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "f"
    write_atomic(path, lambda f: f.write(b"old"))

    def fail_half_way(f):
        f.write(b"new, half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, fail_half_way)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]
    write_atomic(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_remove_leftovers_takes_only_temporary_files(tmp_path):
    left = temp_path(tmp_path / "metrics.jsonl")
    left.write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("kept")
    (tmp_path / ".hidden").write_text("kept")
    assert remove_leftovers(tmp_path) == [(left, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "metrics.jsonl"]
