"""bench_model.py --parallel on two CPU processes over gloo: rows with world size, one-GPU baseline and scaling
efficiency, written by rank 0 alone; and the launch error without torchrun."""

import csv
import json
from pathlib import Path

import pytest

import bench_model
from tests.ranks import start_ranks

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--vocab-size", "64",
        "--context-lengths", "16", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--device", "cpu"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _bench_main(rank: int, argv: list[str]) -> int:
    """A rank's process: bench_model.main, as `torchrun bench_model.py argv` would run it."""
    rows = bench_model.main(argv)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def run_bench(tmp_path: Path, *extra: str) -> tuple[list[dict], Path, list]:
    out = tmp_path / "out"
    results = start_ranks(_bench_main, ([*TINY, "--out", str(out), *extra],), tmp_path / "logs")
    assert [r.exit_code for r in results] == [0, 0], "\n".join(
        f"rank {i} (exit {r.exit_code}):\n{r.stderr[-3000:]}" for i, r in enumerate(results))
    return json.loads((out / "results.json").read_text())["rows"], out, results


@pytest.mark.slow  # two processes over gloo
def test_ddp_rows_report_scaling_efficiency_against_one_device(tmp_path):
    rows, out, results = run_bench(tmp_path, "--parallel", "ddp", "--mode", "train-step,forward-backward")
    assert [r["mode"] for r in rows] == ["train-step", "forward-backward"]
    for r in rows:
        assert r["status"] == "ok" and r["parallel"] == "ddp" and r["world_size"] == 2 and r["batch_size"] == 2
        # DDP reduces the gradients after the backward: the optimizer steps after it, as in the one-GPU baseline
        assert r["overlap_optimizer"] is False and r["optimizer"] == "adamw"
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_1gpu"] > 0
        # weak scaling: both ranks run batch_size sequences per step
        assert r["tokens_per_s"] == pytest.approx(2 * 2 * 16 / (r["total_ms_mean"] / 1e3))
        assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_s"] / (2 * r["tokens_per_s_1gpu"]))
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # CPU
    with (out / "results.csv").open() as f:
        assert csv.DictReader(f).fieldnames == [*bench_model.COLUMNS, *bench_model.PARALLEL_COLUMNS]
    md = (out / "results.md").read_text()
    assert "torchrun --nproc-per-node 2 bench_model.py" in md
    assert "## Scaling, ddp over 2 GPUs" in md
    eff = rows[0]["scaling_efficiency"]
    assert f"| custom T=16 sdpa fp32 compile=off train-step | 2 | {rows[0]['tokens_per_s_1gpu']:.0f} |" in md
    assert f"| {eff:.3f} |" in md
    assert "2 configurations on" in results[0].stdout and results[1].stdout == ""  # rank 0 alone prints


@pytest.mark.slow  # two processes over gloo
def test_fsdp_runs_every_mode(tmp_path):
    rows, _, _ = run_bench(tmp_path, "--parallel", "fsdp", "--mode", "forward,train-step")
    assert [(r["mode"], r["status"], r["parallel"], r["world_size"]) for r in rows] == [
        ("forward", "ok", "fsdp", 2), ("train-step", "ok", "fsdp", 2)]
    for r in rows:
        assert r["tokens_per_s_1gpu"] > 0
        assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_s"] / (2 * r["tokens_per_s_1gpu"]))


@pytest.mark.parametrize("extra, message", [
    ([], "--parallel ddp needs the process variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
         "MASTER_PORT missing); launch with `torchrun --nproc-per-node N bench_model.py --parallel ddp ...`"),
    (["--profile", "prof"], "--profile is for one device; drop --parallel"),
])
def test_parallel_launch_errors_name_the_problem(monkeypatch, capsys, extra, message):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        bench_model.main([*TINY, "--parallel", "ddp", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
