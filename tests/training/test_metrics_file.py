import json
import os
from pathlib import Path

import pytest

from training import metrics_file
from training.metrics_file import MetricsError, MetricsFile


def rows_text(*steps) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def test_appends_one_row_per_line_and_resumes_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = MetricsFile(path, append=False)
    f.write({"step": 1, "loss": 2.5})
    f.write({"step": 2, "loss": 2.0})
    f.sync()
    f.close()
    f = MetricsFile(path, append=True)
    f.write({"step": 3, "loss": 1.5})
    f.close()
    assert [r["step"] for r in metrics_file.read_rows(path)] == [1, 2, 3]
    MetricsFile(path, append=False).close()
    assert path.read_text() == ""


def test_a_torn_last_line_is_ignored_with_a_warning_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows_text(1, 2) + '{"step": 3, "lo')
    warnings = []
    assert [r["step"] for r in metrics_file.read_rows(path, warnings.append)] == [1, 2]
    assert warnings == [f"warning: {path}: ignoring its torn last line (an interrupted write)"]
    path.write_text(rows_text(1) + '{"step": 2, "loss": 1.\n\n')  # torn, then newlines: still the last line
    assert [r["step"] for r in metrics_file.read_rows(path, lambda m: None)] == [1]


def test_a_bad_line_before_the_last_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows_text(1) + "garbage\n" + rows_text(3))
    with pytest.raises(MetricsError, match=rf"^{path} line 2 is not JSON \(.*\); repair or delete that line$"):
        metrics_file.read_rows(path)
    path.write_text(rows_text(1) + '{"loss": 1}\n' + rows_text(3))
    with pytest.raises(MetricsError, match=rf'^{path} line 2 is not a metrics row \(no integer "step"\)$'):
        metrics_file.read_rows(path)


def test_cut_after_keeps_rows_up_to_the_checkpoint_by_renaming_a_new_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows_text(1, 2, 3, 4, 5) + '{"step": 6, "lo')
    inode = path.stat().st_ino
    assert metrics_file.cut_after(path, 3, lambda m: None) == 3
    assert path.read_text() == rows_text(1, 2, 3)
    assert path.stat().st_ino != inode, "a new file renamed over the old one, not the old one rewritten in place"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    assert metrics_file.cut_after(tmp_path / "absent.jsonl", 3) == 0

    # A kill while the new file is written: the old file is still whole.
    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        metrics_file.cut_after(path, 2)
    assert path.read_text() == rows_text(1, 2, 3) and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_full_disk_names_the_file_and_leaves_no_half_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows_text(1))
    f = MetricsFile(path)

    class FullAfter:
        """A raw file that takes 10 bytes, then reports a full disk."""

        def __init__(self, raw):
            self.raw = raw

        def fileno(self):
            return self.raw.fileno()

        def write(self, data):
            if os.fstat(self.raw.fileno()).st_size >= len(rows_text(1)) + 10:
                raise OSError(28, "No space left on device")
            return self.raw.write(bytes(data[:10]))

        def close(self):
            self.raw.close()

    f._file = FullAfter(f._file)
    with pytest.raises(MetricsError, match=rf"^cannot write {path}: No space left on device$"):
        f.write({"step": 2, "loss": 0.5})
    f.close()
    assert path.read_text() == rows_text(1)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_real_full_device():
    f = MetricsFile(Path("/dev/full"))
    with pytest.raises(MetricsError, match="^cannot write /dev/full: No space left on device$"):
        f.write({"step": 1})
    f.close()


def test_an_unwritable_path_is_named(tmp_path):
    with pytest.raises(MetricsError, match=rf"^cannot write {tmp_path}/no/metrics.jsonl: No such file or directory$"):
        MetricsFile(tmp_path / "no" / "metrics.jsonl")
