"""bench_model.py end to end on CPU with a tiny custom model: rows, files, profiling flags, OOM rows, bad args."""

import csv
import datetime
import json

import pytest
import torch

import bench_model
import benchmarking.output
from benchmarking import model_report
from benchmarking.oom import INJECT_OOM_ENV
from model import ModelConfig, TransformerLM
from profiling import nvtx
from training.optim import optimizer_names
from training.optim.overlapped import OverlappedOptimizer

TINY = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128", "--vocab-size", "256",
        "--batch-size", "2", "--warmup", "1", "--steps", "2", "--device", "cpu"]
TINY_PARAMS = TransformerLM(ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256)).num_params()
PHASES_OF = {
    "forward": {"forward", "total"},
    "forward-backward": {"forward", "backward", "total"},
    "train-step": {"forward", "backward", "optimizer", "total"},
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    rows = bench_model.main([*TINY, "--context-lengths", "16,32", "--attn", "naive",
                             "--mode", "forward,forward-backward,train-step", "--out", str(out)])
    return rows, out


@pytest.mark.slow  # the sweep: six configurations
def test_every_mode_and_context_gets_a_row_with_positive_figures(sweep):
    rows, _ = sweep
    assert [(r["context_length"], r["mode"]) for r in rows] == [
        (t, m) for t in (16, 32) for m in ("forward", "forward-backward", "train-step")]
    for r in rows:
        assert r["status"] == "ok" and r["size"] == "custom"
        assert r["params"] == TINY_PARAMS
        assert r["optimizer"] == "adamw"
        # Timed without clipping, a one-process train-step steps the optimizer inside its backward; no other mode
        # steps it at all.
        assert r["overlap_optimizer"] == (r["mode"] == "train-step")
        for phase in model_report.PHASES:
            mean, std = r[f"{phase}_ms_mean"], r[f"{phase}_ms_std"]
            if phase in PHASES_OF[r["mode"]]:
                assert mean > 0 and std >= 0
            else:
                assert mean is None and std is None
        parts = sum(r[f"{p}_ms_mean"] for p in ("forward", "backward", "optimizer") if r[f"{p}_ms_mean"])
        assert r["total_ms_mean"] == pytest.approx(parts, rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(2 * r["context_length"] / (r["total_ms_mean"] / 1e3))
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # CPU: no peak FLOPs, no allocator stats


@pytest.mark.slow  # the sweep: six configurations
def test_output_files_have_the_documented_columns(sweep):
    rows, out = sweep
    with (out / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == list(bench_model.COLUMNS)
        csv_rows = list(reader)
    assert len(csv_rows) == len(rows)
    assert all(int(r["params"]) == TINY_PARAMS and float(r["total_ms_mean"]) > 0 for r in csv_rows)
    payload = json.loads((out / "results.json").read_text())
    assert payload["environment"]["torch"] == torch.__version__
    assert [set(r) for r in payload["rows"]] == [set(bench_model.COLUMNS)] * len(rows)
    assert payload["config"]["models"]["custom"]["d_model"] == 64
    assert "points" not in payload["config"]  # the rows hold each point's configuration
    md = (out / "results.md").read_text()
    assert "# Model benchmark" in md and "## Total step ms, naive fp32 compile=off train-step opt-overlap" in md
    assert "## Total step ms, naive fp32 compile=off forward-backward\n" in md
    assert "## Environment" in md
    for mode in PHASES_OF:
        assert (out / f"step_time_{mode}.png").stat().st_size > 0


@pytest.mark.slow  # the profiler
def test_profile_writes_a_trace_and_a_cpu_op_table(tmp_path, capsys):
    prof = tmp_path / "prof"
    rows = bench_model.main([*TINY, "--context-lengths", "16", "--attn", "naive", "--mode", "train-step",
                             "--profile", str(prof), "--profile-steps", "2", "--out", str(tmp_path / "out")])
    assert rows[0]["status"] == "ok"
    assert json.loads((prof / "trace.json").read_text())["traceEvents"]
    table = (prof / "kernels.md").read_text()
    assert "CPU ops by self CPU time" in table
    assert "| `aten::mm` |" in table and "| `aten::bmm` |" in table  # naive attention's batched matmuls
    assert "CPU ops by self CPU time" in capsys.readouterr().out


@pytest.mark.slow  # the profiler
def test_profile_of_several_configurations_gets_one_folder_each(tmp_path):
    prof = tmp_path / "prof"
    bench_model.main([*TINY, "--context-lengths", "16,32", "--mode", "forward", "--profile", str(prof),
                      "--profile-steps", "1", "--out", str(tmp_path / "out")])
    folders = sorted(p.name for p in prof.iterdir())
    assert len(folders) == 2 and all((prof / f / "kernels.md").exists() for f in folders)
    assert "T=16" in folders[0] and "T=32" in folders[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_memory_snapshot_on_cpu_fails_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_model.main([*TINY, "--context-lengths", "16", "--memory-snapshot", str(tmp_path / "s.pickle"),
                          "--out", str(tmp_path / "out")])
    assert exit_info.value.code != 0
    assert "--memory-snapshot needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "s.pickle").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory snapshots need CUDA")
def test_memory_snapshot_on_cuda_prints_what_is_live_at_the_peak(tmp_path, capsys):
    bench_model.main([*TINY, "--context-lengths", "16", "--mode", "train-step", "--device", "cuda",
                      "--memory-snapshot", str(tmp_path / "s.pickle"), "--snapshot-steps", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "peak allocated in the window" in out and "allocated before recording" in out
    assert list(tmp_path.glob("s*.pickle"))


@pytest.mark.slow  # a sweep of three
def test_injected_oom_gives_an_oom_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_OOM_ENV, "T=32")
    rows = bench_model.main([*TINY, "--context-lengths", "16,32,48", "--mode", "forward",
                             "--out", str(tmp_path)])
    assert [r["status"] for r in rows] == ["ok", "OOM", "ok"]
    oom = rows[1]
    assert "injected out of memory" in oom["message"]
    assert oom["total_ms_mean"] is None and oom["params"] == TINY_PARAMS
    assert "| custom | 0.1 | 32 |" in (tmp_path / "results.md").read_text()


def test_backend_that_cannot_run_here_is_a_row_not_a_crash(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("sdpa-flash runs on CUDA")
    rows = bench_model.main([*TINY, "--context-lengths", "16", "--attn", "sdpa-flash,sdpa", "--mode", "forward",
                             "--out", str(tmp_path)])
    assert [(r["attn"], r["status"]) for r in rows] == [("sdpa-flash", "unsupported"), ("sdpa", "ok")]
    assert "CUDA" in rows[0]["message"]


@pytest.mark.slow  # bench_model.py end to end
def test_explain_memory_prints_the_breakdown_beside_the_measurement(tmp_path, capsys):
    rows = bench_model.main([*TINY, "--context-lengths", "32", "--attn", "naive", "--mode", "train-step",
                             "--explain-memory", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for needle in ("parameters (fp32 master weights)", "AdamW exp_avg and exp_avg_sq", "attention probs",
                   "log-softmax of the logits", "expected peak", "measured: saved for backward",
                   "measured: peak allocated over the timed steps"):
        assert needle in printed
    lines = {line[:68].strip(): line[68:].strip() for line in printed.splitlines() if len(line) > 68}
    # the eager forward saves exactly what the accounting lists
    assert lines["measured: saved for backward, eager (incl. autocast weight copies)"] == \
        lines["expected, same terms"]
    assert "## Memory accounting" in (tmp_path / "results.md").read_text()
    assert rows[0]["status"] == "ok"


@pytest.mark.slow  # bench_model.py end to end
def test_nvtx_ranges_cover_warmup_steps_phases_and_attention(tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append(None))
    bench_model.main([*TINY, "--context-lengths", "16", "--attn", "naive", "--mode", "train-step", "--nvtx",
                      "--out", str(tmp_path)])
    names = [n for n in pushed if n is not None]
    for name in ("warmup", "step 0", "step 1", "forward", "backward", "optimizer",
                 "attention.scores", "attention.softmax", "attention.output"):
        assert name in names
    assert len(names) == pushed.count(None)  # balanced
    assert not nvtx.is_enabled()  # main() switches it off again


def test_sweep_order_and_compile_both():
    args = bench_model.parse_args([*TINY, "--sizes", "small", "--context-lengths", "128,256", "--attn", "naive,sdpa",
                                   "--dtype", "fp32,bf16", "--compile", "both", "--mode", "forward,train-step"])
    points = args.points
    assert len(points) == 2 * 2 * 2 * 2 * 2 * 2  # sizes x attn x dtype x compile x context x mode
    assert points[0].size == "small" and points[-1].size == "custom"
    assert points[0].attn == "naive" and points[0].config.execution.attn == "naive"
    assert points[0].context_length == 128 == points[0].config.model.context_length
    assert {p.config.execution.compile for p in points} == {False, True}
    assert {p.config.execution.dtype for p in points} == {"fp32", "bf16"}
    assert bench_model.parse_args([*TINY, "--compile"]).compile == "on"


def test_each_point_carries_its_resolved_training_config():
    point, = bench_model.parse_args([*TINY, "--context-lengths", "32", "--mode", "train-step"]).points
    ex, optim = point.config.execution, point.config.optim
    assert (ex.attn, ex.dtype, ex.compile, ex.cuda_graph, ex.fp8, ex.device) == ("sdpa", "fp32", False, False, "off",
                                                                                   "cpu")
    assert (optim.optimizer, optim.grad_clip) == ("adamw", 0.0)  # timed without clipping
    assert point.config.optim.warmup_steps is not None  # resolved: every automatic default filled


@pytest.mark.parametrize("flag", [["--weight-grads", "autocast"], ["--residual", "autocast"], ["--fused-rope", "off"],
                                  ["--fused-gate-up", "off"], ["--compile-scope", "model"], ["--overlap-optimizer"],
                                  ["--optim-state-dtype", "bf16"], ["--dist-timeout", "60"], ["--no-progress"],
                                  ["--snapshot-max-entries", "100"]])
def test_a_retired_flag_is_refused_in_one_line_without_usage(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_model.parse_args([*TINY, *flag])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: unrecognized arguments: {' '.join(flag)}\n"


def test_our_optimizer_steps_inside_the_backward_of_one_process_train_steps_only():
    args = bench_model.parse_args([*TINY, "--context-lengths", "16", "--mode", "forward,forward-backward,train-step",
                                   "--impl", "ours,hf"])
    assert [(p.impl, p.mode, p.overlapped) for p in args.points] == [
        ("ours", "forward", False), ("ours", "forward-backward", False), ("ours", "train-step", True),
        ("hf", "forward", False), ("hf", "forward-backward", False), ("hf", "train-step", False)]
    for point in args.points:  # the step is built as the row says
        optimizer = bench_model.build_runner(point, torch.device("cpu")).train.optimizer
        assert isinstance(optimizer, OverlappedOptimizer) == point.overlapped, point.label
    assert "opt-overlap" in args.points[2].label and "opt-overlap" not in args.points[1].label
    clipped = bench_model.parse_args([*TINY, "--context-lengths", "16", "--mode", "train-step", "--grad-clip", "1"])
    assert not clipped.points[0].overlapped and clipped.points[0].config.optim.grad_clip == 1.0


def test_the_parallel_baseline_is_the_same_config_without_the_overlapped_optimizer(monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    args = bench_model.parse_args([*TINY, "--context-lengths", "16", "--mode", "train-step", "--parallel", "ddp"])
    point, = args.points
    assert args.world_size == 2 and point.config.execution.parallel == "ddp" and point.batch_size == 2
    assert point.config.data.batch_size == 4  # the global batch: 2 sequences per rank
    assert not point.overlapped and "opt-overlap" not in point.label
    # The one-GPU baseline: the plain model of one process, built from the same config, its optimizer after the
    # backward as under DDP.
    baseline = bench_model.build_runner(point, torch.device("cpu"))
    assert isinstance(baseline.model, TransformerLM) and baseline.train.step_model is baseline.model
    assert not isinstance(baseline.train.optimizer, OverlappedOptimizer)
    row = bench_model.base_row(point, bench_model.replace_parallel(args))
    assert row["overlap_optimizer"] is False and "parallel" not in row


@pytest.mark.slow  # a sweep of two
def test_the_optimizer_list_gives_a_row_per_optimizer(tmp_path):
    rows = bench_model.main([*TINY, "--context-lengths", "16", "--mode", "train-step", "--attn", "naive",
                             "--optimizer", "adamw,adamw-bf16", "--out", str(tmp_path)])
    assert [(r["optimizer"], r["status"]) for r in rows] == [("adamw", "ok"), ("adamw-bf16", "ok")]
    assert all(r["total_ms_mean"] > 0 and r["optimizer_ms_mean"] is not None for r in rows)
    with (tmp_path / "results.csv").open() as f:
        assert [r["optimizer"] for r in csv.DictReader(f)] == ["adamw", "adamw-bf16"]
    md = (tmp_path / "results.md").read_text()
    assert "## Total step ms, naive fp32 compile=off train-step opt-overlap adamw-bf16" in md
    assert set(optimizer_names()) >= {"adamw", "adamw-bf16"}


@pytest.mark.slow  # a sweep of two
def test_n_kv_heads_builds_gqa_models(tmp_path):
    rows = bench_model.main([*TINY, "--n-kv-heads", "2", "--context-lengths", "16", "--mode", "train-step",
                             "--attn", "naive,sdpa", "--out", str(tmp_path)])
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=256, n_kv_heads=2)
    assert [(r["attn"], r["status"]) for r in rows] == [("naive", "ok"), ("sdpa", "ok")]
    assert all(r["params"] == TransformerLM(cfg).num_params() < TINY_PARAMS for r in rows)
    args = bench_model.parse_args([*TINY, "--sizes", "small", "--n-kv-heads", "2", "--context-lengths", "16"])
    assert [(p.size, p.cfg.n_kv_heads) for p in args.points] == [("small", 2), ("custom", 2)]
    model = bench_model.build_runner(args.points[1], torch.device("cpu")).model
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 2 * 16, 64)


class _FrozenClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 1, 2, 3, 4, 5)


@pytest.mark.slow  # two runs of bench_model.py
def test_without_out_each_run_writes_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(benchmarking.output, "datetime", _FrozenClock)  # two runs in the same second
    for _ in range(2):
        bench_model.main([*TINY, "--context-lengths", "16", "--mode", "forward", "--attn", "naive"])
    runs = sorted(p.name for p in (tmp_path / "runs" / "bench_model").iterdir())
    assert runs == ["20250102-030405", "20250102-030405-2"]
    assert all((tmp_path / "runs" / "bench_model" / name / "results.csv").exists() for name in runs)


def test_an_out_that_holds_an_earlier_run_is_refused(tmp_path, capsys):
    (tmp_path / "results.csv").write_text("size\n")
    with pytest.raises(SystemExit) as exit_info:
        bench_model.main([*TINY, "--context-lengths", "16", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"--out {tmp_path} holds an earlier run's results (results.csv)" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_both_gives_a_graphed_row_beside_the_plain_one(tmp_path):
    rows = bench_model.main([*TINY, "--context-lengths", "32", "--attn", "sdpa", "--mode", "train-step",
                             "--cuda-graph", "both", "--warmup", "3", "--steps", "2", "--device", "cuda",
                             "--out", str(tmp_path)])
    assert [r["cuda_graph"] for r in rows] == [False, True]
    assert all(r["status"] == "ok" and r["total_ms_mean"] > 0 for r in rows)
    assert rows[1]["forward_ms_mean"] is None  # one replay: the phases are not split
    # Counted from the capture: the graph's pool holds the step's activations (a reset after it would miss them).
    assert rows[1]["peak_mem_gib"] >= 0.9 * rows[0]["peak_mem_gib"]


@pytest.mark.parametrize("extra,message", [
    (["--sizes", "huge"], "unknown size 'huge'; valid: "),
    (["--attn", "fastest"], "unknown attention backend 'fastest'; valid: naive"),
    (["--n-heads", "5"], "d_model (64) must be divisible by n_heads (5)"),
    (["--n-kv-heads", "3"], "n_kv_heads must divide n_heads (4), got 3"),
    (["--dtype", "fp16"], "unknown dtype 'fp16'; valid: fp32, bf16"),
    (["--mode", "backward"], "unknown mode 'backward'; valid: forward, forward-backward, train-step"),
    (["--context-lengths", "128,abc"], "'abc' is not an integer"),
    (["--context-lengths", "0"], "values must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--cuda-graph", "--mode", "forward"], "--cuda-graph captures the whole train step: use --mode train-step"),
    (["--cuda-graph", "--mode", "train-step", "--warmup", "2"], "--cuda-graph needs --warmup >= 3"),
    (["--cuda-graph", "--mode", "train-step", "--warmup", "3"], "--cuda-graph: CUDA graphs need a GPU"),
    (["--fp8", "tensorwise", "--dtype", "fp32"], "--fp8 tensorwise trains under bf16 autocast: add --dtype bf16 "
                                                 "(got fp32)"),
    (["--fp8", "tensorwise", "--dtype", "bf16", "--d-model", "72", "--n-heads", "4"],
     "--fp8 tensorwise needs a --d-model that is a multiple of 16"),
    (["--optimizer", "adamw-bf16", "--mode", "forward"], "--optimizer is the train step's: use --mode train-step"),
    (["--optimizer", "sgd", "--mode", "train-step"], "unknown optimizer 'sgd'; valid: adamw, adamw-bf16"),
    pytest.param(["--device", "cuda"], "no CUDA GPU is visible; use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")),
])
def test_bad_arguments_exit_with_one_line_naming_the_problem(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_model.parse_args([*TINY, *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err


def test_unknown_size_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--sizes", "small,giant"])
    err = capsys.readouterr().err
    assert "small, medium, large, xl, 2.7B" in err


def test_custom_size_needs_all_four_dims(capsys):
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--d-model", "64", "--n-heads", "4"])
    assert "missing --n-layers --d-ff" in capsys.readouterr().err
