import json
import math
from pathlib import Path

import pytest

from benchmarking.report import (collect_columns, format_value, log_wandb, markdown_table, pivot_markdown,
                                 plot_lines, read_csv, write_csv, write_json, write_markdown)

ROWS = [
    {"backend": "naive", "seq": 256, "d": 16, "ms": 1.25, "status": "ok"},
    {"backend": "flash", "seq": 256, "d": 16, "ms": 0.5, "status": "ok"},
    {"backend": "naive", "seq": 1024, "d": 16, "ms": None, "status": "OOM"},
    {"backend": "flash", "seq": 1024, "d": 16, "ms": 2.0, "status": "ok", "extra": "a|b"},
]


@pytest.mark.parametrize("value,fmt,text", [
    (None, None, ""), (float("nan"), None, ""), (True, None, "yes"), (3, None, "3"), (1.23456, None, "1.235"),
    (1234.5, None, "1234"), (0.000012345, None, "1.23e-05"), (2.5, ".1f", "2.5"), ("OOM", None, "OOM"),
])
def test_format_value(value, fmt, text):
    assert format_value(value, fmt) == text


def test_collect_columns_in_first_seen_order():
    assert collect_columns(ROWS) == ["backend", "seq", "d", "ms", "status", "extra"]


def test_markdown_table_escapes_and_blanks():
    text = markdown_table(ROWS, {"backend": "Backend", "ms": "time (ms)", "extra": "x"})
    lines = text.splitlines()
    assert lines[0] == "| Backend | time (ms) | x |"
    assert lines[4] == "| naive |  |  |"  # None is an empty cell
    assert lines[5] == "| flash | 2.000 | a\\|b |"


def test_pivot_shows_status_where_value_missing():
    lines = pivot_markdown(ROWS, "seq", "backend", "ms").splitlines()
    assert lines[0] == "| seq \\ backend | naive | flash |"
    assert lines[2] == "| 256 | 1.250 | 0.5000 |"
    assert lines[3] == "| 1024 | OOM | 2.000 |"


def test_csv_round_trip(tmp_path):
    path = write_csv(ROWS, tmp_path / "sub" / "r.csv")
    back = read_csv(path)
    assert list(back[0]) == collect_columns(ROWS)
    assert back[2]["ms"] == "" and back[2]["status"] == "OOM"
    assert float(back[1]["ms"]) == 0.5
    assert back[3]["extra"] == "a|b" and back[0]["extra"] == ""


def test_json_has_rows_environment_and_config(tmp_path):
    rows = ROWS + [{"backend": "x", "ms": math.nan, "where": Path("/tmp")}]
    path = write_json(rows, tmp_path / "r.json", {"torch": "2.x"}, {"iters": 3})
    data = json.loads(path.read_text())
    assert data["environment"] == {"torch": "2.x"} and data["config"] == {"iters": 3}
    assert len(data["rows"]) == 5
    assert data["rows"][4]["ms"] is None and data["rows"][4]["where"] == "/tmp"


def test_markdown_document(tmp_path):
    path = write_markdown(tmp_path / "r.md", "Title", ["para", "| a |"], {"gpu_name": "H100", "cuda": None})
    text = path.read_text()
    assert text.startswith("# Title\n\npara\n\n| a |\n\n## Environment")
    assert "| gpu_name | H100 |" in text and "cuda" not in text


def test_plot_lines_writes_png_and_skips_empty(tmp_path):
    path = plot_lines(ROWS, "seq", "ms", "backend", tmp_path / "p.png", facet="d", logx=True, logy=True, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_lines([ROWS[2]], "seq", "ms", "backend", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_log_wandb_offline_writes_a_run(tmp_path):
    image = plot_lines(ROWS, "seq", "ms", "backend", tmp_path / "p.png")
    run_dir = log_wandb(ROWS, mode="offline", project="test", images={"p": image}, directory=tmp_path / "wb",
                        config={"iters": 1})
    assert run_dir is not None
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_log_wandb_logs_further_tables_beside_the_rows(tmp_path):
    from tests.training.wandb_offline import history_and_summary

    curves = [{"recipe": "adamw", "clock_s": 0.0, "val_bpb": 8.0}, {"recipe": "adamw", "clock_s": 1.0, "val_bpb": 7.0}]
    log_wandb(ROWS, mode="offline", project="test", directory=tmp_path / "wb", tables={"curves": curves})
    (row,), _ = history_and_summary(tmp_path / "wb" / "wandb")
    assert {"results", "curves"} <= {key.split("/")[0] for key in row}


def test_log_wandb_rejects_bad_mode():
    with pytest.raises(ValueError, match="offline"):
        log_wandb(ROWS, mode="cloud", project="t")
