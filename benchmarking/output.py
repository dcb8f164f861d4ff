"""The output folder of a benchmark run: a new one per run by default, and never an earlier run's.

    out = args.out or new_out_dir(Path("runs/bench_model"))
    problem = earlier_results(out)      # None, or the one line that refuses it

An --out that holds an earlier run's results is refused rather than overwritten: its tables, plots and JSON would
otherwise mix two runs (a shorter second sweep rewrites results.csv but leaves the first run's plots), and a script
that reads <out>/results.json after the run must not find the previous one. train.py refuses an --out that holds a
run in the same way (training/run/directory.py).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Optional

# What a run of bench_attention.py or bench_model.py writes; any of them marks the folder as an earlier run's.
RESULT_FILES = ("results.md", "results.csv", "results.json", "decode.md", "decode.csv", "decode.json")


def new_out_dir(root: Path) -> Path:
    """A folder under `root` named by the time, that no earlier run wrote (-2, -3, ... after a run of the same
    second)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def earlier_results(out: Path) -> Optional[str]:
    """Why --out cannot take this run (it is a file, or it holds an earlier run's results), or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    found = [name for name in RESULT_FILES if (out / name).exists()]
    if not found:
        return None
    return (f"--out {out} holds an earlier run's results ({', '.join(found)}); give a new or empty folder, or leave "
            "--out out for a new folder per run")
