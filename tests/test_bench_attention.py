"""bench_attention.py end to end on CPU: a tiny sweep, an injected OOM, --explain-memory, bad arguments."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench_attention
from attention import backend_names, list_attention
from benchmarking.oom import INJECT_OOM_ENV
from benchmarking.report import read_csv

REPO = Path(__file__).resolve().parents[1]
SEQS, DS = (16, 32), (16, 32)
OOM_LABEL = "sdpa b1 h2 seq=16 d=16"  # sdpa at the first point only


def sweep_backends():
    names = ["naive", "compiled", "sdpa", "flash-torch", "flash"]
    available = {b.name for b in list_attention() if b.available}
    # flash runs on CPU under TRITON_INTERPRET=1 (set in tests/conftest.py); skip it where it is not registered.
    return [n for n in names if n in available]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_attention")
    argv = ["--backends", ",".join(sweep_backends()), "--seq-lens", ",".join(map(str, SEQS)),
            "--d-heads", ",".join(map(str, DS)), "--dtype", "fp32", "--causal", "yes", "--batch", "1",
            "--heads", "2", "--iters", "2", "--warmup", "0", "--out", str(out), "--wandb", "offline"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(INJECT_OOM_ENV, OOM_LABEL)
        result = bench_attention.main(argv)
    return result, out


def row(rows, backend, seq, d):
    [match] = [r for r in rows if r["backend"] == backend and r["seq"] == seq and r["d_head"] == d]
    return match


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_sweep_runs_every_point_and_backend(sweep):
    result, _ = sweep
    backends = sweep_backends()
    assert "flash-torch" in backends
    if "flash" in backend_names():  # registered: it must run here (TRITON_INTERPRET=1 on CPU)
        assert "flash" in backends
    assert len(result.rows) == len(SEQS) * len(DS) * len(backends)
    assert [(r["seq"], r["d_head"]) for r in result.rows[:: len(backends)]] == [(16, 16), (32, 16), (16, 32), (32, 32)]


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_ok_rows_have_times_tflops_and_small_errors(sweep):
    result, _ = sweep
    ok = [r for r in result.rows if r["status"] == "ok"]
    assert len(ok) == len(result.rows) - 1  # only the injected OOM
    for r in ok:
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0, r
        assert r["bwd_ms"] is None or r["bwd_ms"] > 0  # None only when fwdbwd - fwd is lost in noise
        if r["bwd_method"] == "retain_graph":
            assert r["bwd_ms"] > 0
        flop = 4 * 1 * 2 * r["seq"] ** 2 * r["d_head"] / 2  # causal
        assert r["fwd_tflops"] == pytest.approx(flop / (r["fwd_ms"] * 1e-3) / 1e12)
        assert r["check"] == "ok" and r["rel_err"] < 1e-4, r
        for key in ("err_out", "err_dq", "err_dk", "err_dv"):
            assert 0 <= r[key] < 1e-4
        assert (r["saved_mib"] is None) == (r["device"] == "cpu")  # the CUDA allocator's figure; none on the CPU
        assert r["saved_tensors_mib"] > 0
    # naive keeps (seq x seq) probabilities, flash-torch only o and L: at seq 32, d 16 naive saves more.
    assert row(result.rows, "naive", 32, 16)["saved_tensors_mib"] > row(result.rows, "flash-torch", 32, 16)[
        "saved_tensors_mib"]


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_flash_rows_and_report_say_which_kernels_ran(sweep):
    result, out = sweep
    if "flash" not in sweep_backends():
        pytest.skip("flash cannot run here")
    for r in result.rows:
        if r["backend"] == "flash":
            assert r["fwd_kernel"] in ("triton", "hopper") and r["bwd_kernel"] in ("triton", "hopper")
            assert r["kernel_reason"].startswith(f"forward {r['fwd_kernel']}: ")
        else:
            assert r["fwd_kernel"] is None and r["kernel_reason"] is None
    assert "## Kernels flash ran (Triton or Hopper), and why" in (out / "results.md").read_text()


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_baseline_ratio(sweep):
    result, _ = sweep
    for r in result.rows:
        if r["backend"] == "naive":
            assert r["fwd_ratio"] == r["bwd_ratio"] == r["fwdbwd_ratio"] == 1.0
        elif r["status"] == "ok":
            base = row(result.rows, "naive", r["seq"], r["d_head"])
            assert r["fwd_ratio"] == pytest.approx(r["fwd_ms"] / base["fwd_ms"])


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_injected_oom_is_a_row_and_the_sweep_goes_on(sweep):
    result, _ = sweep
    oom = row(result.rows, "sdpa", 16, 16)
    assert oom["status"] == "OOM" and "injected" in oom["note"]
    assert oom["fwd_ms"] is None and oom["fwd_ratio"] is None and oom["rel_err"] is None
    assert row(result.rows, "sdpa", 32, 16)["status"] == "ok"  # next point
    assert row(result.rows, "flash-torch", 16, 16)["status"] == "ok"  # next backend at the same point


@pytest.mark.slow  # the sweep (the fixture): most of a minute on 2 CPU cores
def test_output_files(sweep):
    result, out = sweep
    csv_rows = read_csv(out / "results.csv")
    assert list(csv_rows[0]) == bench_attention.COLUMNS
    assert len(csv_rows) == len(result.rows)
    assert {r["status"] for r in csv_rows} == {"ok", "OOM"}
    assert float(row_csv(csv_rows, "naive")["fwd_ratio"]) == 1.0

    data = json.loads((out / "results.json").read_text())
    assert len(data["rows"]) == len(result.rows)
    for key in ("gpu_name", "torch", "triton", "cuda", "cudnn", "python", "date", "git_commit"):
        assert key in data["environment"]
    assert data["environment"]["torch"] == torch.__version__
    assert data["config"]["seq_lens"] == list(SEQS) and data["config"]["baseline"] == "naive"

    md = (out / "results.md").read_text()
    assert "## Forward + backward time (ms) by backend" in md
    assert "### naive, fp32, causal" in md and "backward (ms)" in md
    assert "| seq \\ d_head | 16 | 32 |" in md
    assert "| 16 | OOM |" in md  # sdpa's forward table at d 16
    assert "## Correctness" in md and "## Environment" in md

    for stem in ("time_fwd", "time_bwd", "time_fwdbwd", "memory", "tflops"):
        png = out / f"{stem}_fp32_causal.png"
        assert png.read_bytes()[:4] == b"\x89PNG", png
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


def row_csv(rows, backend):
    return next(r for r in rows if r["backend"] == backend)


@pytest.mark.slow  # bench_attention.py end to end
def test_explain_memory_prints_expected_and_measured(capsys, tmp_path):
    # On the CPU on every machine: the byte counts below are those of the CPU kernels (CUDA's sdpa saves more).
    result = bench_attention.main(["--explain-memory", "--backends", "naive,sdpa", "--seq-lens", "16,64",
                                   "--d-heads", "16", "--batch", "1", "--heads", "2", "--causal", "no",
                                   "--device", "cpu", "--out", str(tmp_path / "x")])
    text = capsys.readouterr().out
    # The point explained is the largest seq: 1 x 2 x 64^2 x 4 B = 32 KiB of probabilities for naive.
    assert "b1 h2 seq=64 d=16 fp32 full" in text
    assert "[naive]" in text and "[sdpa]" in text
    assert "saved for backward (not q,k,v): expected 32.00 KiB, measured 32.00 KiB" in text
    # sdpa: o (1x2x64x16 fp32 = 8 KiB) + log-sum-exp (1x2x64 fp32 = 512 B)
    assert "saved for backward (not q,k,v): expected 8.50 KiB, measured 8.50 KiB" in text
    assert [r["backend"] for r in result.rows] == ["naive", "sdpa"]
    assert result.explanation in text
    assert not (tmp_path / "x").exists()  # explaining writes no result files


def test_presets_and_overrides():
    parser = bench_attention.build_parser()

    def resolve(*argv):
        return bench_attention.resolve_config(parser.parse_args(list(argv)), parser)

    seed = resolve("--preset", "seed")
    assert (seed.batch, seed.heads, seed.d_heads, seed.seq_lens, seed.dtypes, seed.causal, seed.iters) == (
        8, 1, [16, 32, 64, 128], [256, 1024, 4096, 8192, 16384], ["fp32"], [False], 100)
    flash = resolve("--preset", "flash")
    assert flash.seq_lens[0] == 128 and flash.seq_lens[-1] == 65536 and len(flash.seq_lens) == 10
    assert flash.dtypes == ["bf16", "fp32"] and flash.causal == [True] and flash.batch == 1
    board = resolve("--preset", "leaderboard")
    assert board.backends == ["flash", "sdpa", "sdpa-flash", "sdpa-cudnn", "flex"]
    assert (board.seq_lens, board.d_heads, board.dtypes, board.heads) == ([16384], [64], ["bf16"], 16)
    over = resolve("--preset", "seed", "--batch", "2", "--seq-lens", "64", "--causal", "both", "--backends", "naive")
    assert (over.batch, over.seq_lens, over.causal, over.backends) == (2, [64], [False, True], ["naive"])
    assert over.d_heads == [16, 32, 64, 128]  # not overridden: from the preset
    default = resolve()
    available = [b.name for b in list_attention() if b.available]
    assert default.backends == available and default.baseline == "naive"


@pytest.mark.parametrize("argv,message", [
    (["--backends", "naive,nope"], "unknown attention backend 'nope'; valid: naive, compiled"),
    (["--baseline", "fastest"], "unknown attention backend 'fastest'"),
    (["--dtype", "fp32,fp64"], "unknown dtype 'fp64'; valid: fp32, fp16, bf16"),
    (["--seq-lens", "256,0"], "argument --seq-lens: sizes must be positive, got 0"),
    (["--d-heads", "64,x"], "argument --d-heads: expected comma-separated positive integers, got 'x'"),
    (["--batch", "-2"], "argument --batch: sizes must be positive, got -2"),
    (["--iters", "0"], "argument --iters: sizes must be positive, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--causal", "maybe"], "argument --causal: invalid choice: 'maybe'"),
    (["--wandb", "cloud"], "argument --wandb: invalid choice: 'cloud'"),
    (["--graph-timing", "--device", "cpu"], "--graph-timing replays CUDA graphs: it needs --device cuda, got cpu"),
    (["--heads", "8", "--kv-heads", "3"], "--kv-heads 3: must divide --heads 8"),
    (["--softcap", "-1"], "argument --softcap: must be a finite number > 0, got -1"),
    (["--softcap", "inf"], "argument --softcap: must be a finite number > 0, got inf"),
    (["--window", "0"], "argument --window: sizes must be positive, got 0"),
    (["--preset", "variants", "--seq-lens", "64"], "--seq-lens: --preset variants lists its own points"),
    (["--preset", "training", "--window", "64"], "--window: --preset training lists its own points"),
    (["--decode", "1", "--softcap", "5"], "--decode times GQA (--kv-heads) and windows (--window); --softcap"),
    (["--rounds", "0"], "argument --rounds: sizes must be positive, got 0"),
    (["--decode", "1", "--rounds", "3"], "--rounds 3: --decode times each point once"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err  # one line, no usage dump


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(["--device", "cuda"])
    assert "no CUDA GPU is available" in capsys.readouterr().err


def test_list_backends(capsys):
    assert bench_attention.main(["--list-backends"]) is None
    text = capsys.readouterr().out
    for b in list_attention():
        assert b.name in text
    assert os.environ.get(INJECT_OOM_ENV) is None  # the sweep fixture's hook does not leak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_timing_adds_replayed_times(tmp_path):
    """Replayed times in every round (--rounds 2: the second round captures and replays again)."""
    result = bench_attention.main(["--backends", "flash,sdpa", "--baseline", "sdpa", "--seq-lens", "256",
                                   "--d-heads", "64", "--heads", "4", "--batch", "2", "--iters", "10",
                                   "--warmup", "2", "--no-plots", "--graph-timing", "--rounds", "2",
                                   "--out", str(tmp_path)])
    for row in result.rows:
        assert row["status"] == "ok" and row["check"] == "ok" and row["note"] is None, row
        assert 0 < row["fwd_graph_ms"] < row["fwdbwd_graph_ms"]
        assert row["fwdbwd_graph_ratio"] == pytest.approx(
            row["fwdbwd_graph_ms"] / result.rows[1]["fwdbwd_graph_ms"])
    assert "replayed from a CUDA graph" in (tmp_path / "results.md").read_text()


def test_deterministic_runs_the_sweep_under_torchs_switch_and_restores_it(tmp_path, monkeypatch):
    """--deterministic: every backend is timed with torch.use_deterministic_algorithms on (flash's backward then
    runs its deterministic kernels), and the caller's setting comes back after."""
    seen = []
    real = bench_attention.sweep_and_write
    monkeypatch.setattr(bench_attention, "sweep_and_write", lambda *a: seen.append(
        torch.are_deterministic_algorithms_enabled()) or real(*a))
    before = torch.are_deterministic_algorithms_enabled()
    bench_attention.main(["--backends", "naive", "--seq-lens", "16", "--d-heads", "16", "--iters", "1", "--warmup",
                          "0", "--no-plots", "--device", "cpu", "--deterministic", "--out", str(tmp_path)])
    assert seen == [True]
    assert torch.are_deterministic_algorithms_enabled() == before


def test_rounds_take_turns_and_keep_each_times_median(tmp_path, monkeypatch):
    """--rounds 3: after each point's first round, every measured backend is timed twice more, taking turns on the
    same inputs; each time column is the median of its three rounds, and the ratios and TFLOP/s follow it."""
    calls = []
    real = bench_attention.time_again

    def recorded(name, point, inputs, device, **kwargs):
        calls.append((name, point.seq))
        times = real(name, point, inputs, device, **kwargs)
        return {key: None if t is None else 1000.0 * len(calls) for key, t in times.items()}

    monkeypatch.setattr(bench_attention, "time_again", recorded)
    result = bench_attention.main(["--backends", "naive,sdpa", "--baseline", "sdpa", "--seq-lens", "16,32",
                                   "--d-heads", "16", "--heads", "2", "--iters", "2", "--warmup", "0", "--no-plots",
                                   "--device", "cpu", "--rounds", "3", "--out", str(tmp_path)])
    assert calls == [("naive", 16), ("sdpa", 16)] * 2 + [("naive", 32), ("sdpa", 32)] * 2
    for row in result.rows:
        later = [1000.0 * i for i, call in enumerate(calls, 1) if call == (row["backend"], row["seq"])]
        assert row["fwd_ms"] == later[0] and row["fwdbwd_ms"] == later[0]  # the first round's was the smallest
        assert row["fwd_tflops"] == pytest.approx(4 * 2 * row["seq"] ** 2 / 2 * 16 / (later[0] * 1e-3) / 1e12,
                                                  rel=0.1)
    assert [r["fwdbwd_ratio"] for r in result.rows] == pytest.approx([1000 / 2000, 1, 5000 / 6000, 1])
    assert "then the median of 3 such rounds, the backends taking turns" in (tmp_path / "results.md").read_text()


def test_listed_point_presets():
    parser = bench_attention.build_parser()
    variants = bench_attention.resolve_config(parser.parse_args(["--preset", "variants", "--dtype", "fp16"]), parser)
    points = variants.points()
    assert [p.label() for p in points] == [
        "b4 h32 seq=8192 d=128 fp16 causal kv8",
        "b1 h16 seq=16384 d=64 fp16 causal",
        "b1 h16 seq=16384 d=64 fp16 causal window=1024",
        "b1 h16 seq=16384 d=64 fp16 causal docs=1024",
        "b1 h16 seq=16384 d=64 fp16 causal softcap=50",
        "b1 h16 seq=16384 d=64 fp16 causal kv4 window=1024 softcap=50 docs=1024"]
    training = bench_attention.resolve_config(parser.parse_args(["--preset", "training"]), parser)
    assert training.baseline == "sdpa-cudnn" and len(training.points()) == 13
    assert [p.causal for p in training.points()].count(False) == 1
    assert [p.label() for p in training.points() if p.kv_heads] == [
        "b8 h16 seq=4096 d=128 bf16 causal kv4", "b1 h64 seq=8192 d=128 bf16 causal kv8"]


@pytest.mark.slow  # two sweeps, flash's in the interpreter
def test_variant_flags_measure_every_backend_against_the_float64_reference(tmp_path):
    names = [n for n in ("naive", "sdpa", "flash-torch", "flash") if n in {b.name for b in list_attention()
                                                                          if b.available}]
    argv = ["--backends", ",".join(names), "--seq-lens", "40", "--d-heads", "16", "--heads", "4", "--kv-heads", "2",
            "--window", "9", "--doc-len", "12", "--dtype", "fp32", "--iters", "1", "--warmup", "0", "--no-plots"]
    result = bench_attention.main([*argv, "--out", str(tmp_path / "masks")])
    for r in result.rows:
        assert (r["status"], r["check"], r["kv_heads"], r["window"], r["doc_len"]) == ("ok", "ok", 2, 9, 12), r
        assert r["err_dk"] is not None and r["point"] == "b1 h4 seq=40 d=16 fp32 causal kv2 window=9 docs=12"
        # Windows and documents count only the scores computed: fewer than the causal half.
        assert r["fwd_tflops"] * 1e12 * r["fwd_ms"] * 1e-3 < 4 * 4 * 40 * 41 / 2 * 16
    capped = bench_attention.main([*argv, "--softcap", "5", "--out", str(tmp_path / "capped")])
    sdpa = next(r for r in capped.rows if r["backend"] == "sdpa")
    assert sdpa["status"] == "unsupported" and "logit soft-capping" in sdpa["note"]
    assert all(r["check"] == "ok" for r in capped.rows if r["backend"] != "sdpa")
    text = (tmp_path / "capped" / "results.md").read_text()
    assert "softcap=5" in text and "does not support logit soft-capping" in text


@pytest.mark.slow  # bench_attention.py end to end
def test_an_out_folder_with_an_earlier_run_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = ["--backends", "naive", "--seq-lens", "16", "--d-heads", "16", "--heads", "1", "--iters", "1", "--warmup",
            "0", "--no-plots"]
    assert bench_attention.main([*argv, "--out", str(tmp_path / "empty")]).complete  # an empty folder is taken
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main([*argv, "--out", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "holds an earlier run's results (results.md, results.csv, results.json)" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warnings and refusals of a CPU")
def test_gpu_sized_presets_warn_on_the_cpu_and_name_a_cpu_sized_run(capsys, monkeypatch):
    parser = bench_attention.build_parser()

    def resolve(*argv):
        return bench_attention.resolve_config(parser.parse_args([*argv, "--device", "cpu"]), parser)

    for name, preset in bench_attention.PRESETS.items():
        assert preset["sized_for"] == "gpu"  # every preset is, today; the warning reads the mark
        warning = bench_attention.cpu_warning(resolve("--preset", name))
        assert warning.startswith(f"warning: --preset {name} is sized for a GPU: roughly ")
        assert warning.endswith(f"python bench_attention.py {preset['cpu_run']}") and "\n" not in warning
        assert bench_attention.cpu_warning(resolve(*preset["cpu_run"].split())) is None  # minutes, not hours
    # main says so before it starts, then proceeds.
    monkeypatch.setattr(bench_attention, "sweep_and_write", lambda cfg, environment: "swept")
    assert bench_attention.main(["--preset", "leaderboard", "--device", "cpu"]) == "swept"
    assert "warning: --preset leaderboard is sized for a GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the pinned SDPA kernels run on a GPU")
def test_a_sweep_that_cannot_run_here_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(["--backends", "sdpa-flash,sdpa-cudnn"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: none of --backends can run here: sdpa-flash: needs a CUDA GPU")


@pytest.mark.slow  # bench_attention.py in a subprocess
def test_piped_progress_is_plain_lines(tmp_path):
    """A log file gets lines, never the carriage returns of a bar."""
    argv = ["--backends", "naive,sdpa", "--seq-lens", "16,32", "--d-heads", "16", "--heads", "1", "--iters", "1",
            "--warmup", "0", "--dtype", "fp32", "--no-plots", "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "bench_attention.py", *argv], cwd=REPO, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert b"\r" not in done.stdout and b"\r" not in done.stderr
    lines = done.stderr.decode().splitlines()
    assert "bench_attention 0/4 runs: naive b1 h1 seq=16 d=16 fp32 causal" in lines
    assert lines[-1].startswith("wrote 4 rows to ")
