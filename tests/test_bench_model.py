"""bench_model.py end to end on CPU with a tiny custom model: rows, files, profiling flags, OOM rows, bad args."""

import csv
import json

import pytest
import torch

import bench_model
from benchmarking import model_report
from benchmarking.oom import INJECT_OOM_ENV
from model import ModelConfig, TransformerLM
from profiling import nvtx

TINY = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128", "--vocab-size", "256",
        "--batch-size", "2", "--warmup", "1", "--steps", "2", "--device", "cpu", "--no-progress"]
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


def test_every_mode_and_context_gets_a_row_with_positive_figures(sweep):
    rows, _ = sweep
    assert [(r["context_length"], r["mode"]) for r in rows] == [
        (t, m) for t in (16, 32) for m in ("forward", "forward-backward", "train-step")]
    for r in rows:
        assert r["status"] == "ok" and r["size"] == "custom"
        assert r["params"] == TINY_PARAMS
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
    assert payload["config"]["configs"]["custom"]["d_model"] == 64
    md = (out / "results.md").read_text()
    assert "# Model benchmark" in md and "## Total step ms, naive fp32 compile=off train-step" in md
    assert "## Environment" in md
    for mode in PHASES_OF:
        assert (out / f"step_time_{mode}.png").stat().st_size > 0


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
    points = bench_model.sweep_points(args)
    assert len(points) == 2 * 2 * 2 * 2 * 2 * 2  # sizes x attn x dtype x compile x context x mode
    assert points[0].size == "small" and points[-1].size == "custom"
    assert points[0].cfg.attn == "naive" and points[0].context_length == 128
    assert {p.compile for p in points} == {False, True}
    assert bench_model.parse_args([*TINY, "--compile"]).compile == "on"


def test_weight_grads_flag_reaches_every_config_and_the_label():
    default = bench_model.sweep_points(bench_model.parse_args([*TINY, "--sizes", "small"]))
    assert all(p.cfg.fp32_weight_grads for p in default) and "dW=" not in default[0].label
    plain = bench_model.sweep_points(bench_model.parse_args([*TINY, "--sizes", "small", "--weight-grads", "autocast"]))
    assert not any(p.cfg.fp32_weight_grads for p in plain) and plain[0].label.endswith(" dW=autocast")


@pytest.mark.parametrize("flag, other, field, label", [("--fused-rope", "off", "fused_rope", " rope=torch"),
                                                       ("--residual", "autocast", "fp32_residual", " residual=autocast"),
                                                       ("--fused-gate-up", "off", "fused_gate_up", " gate-up=apart")])
def test_model_option_flags_reach_every_config_and_the_label(flag, other, field, label):
    def points(*argv):
        return bench_model.sweep_points(bench_model.parse_args([*TINY, "--sizes", "small", *argv]))

    default = points()
    assert all(getattr(p.cfg, field) for p in default) and label.split("=")[0] + "=" not in default[0].label
    changed = points(flag, other)
    assert not any(getattr(p.cfg, field) for p in changed) and changed[0].label.endswith(label)
    both = points(flag, "both", "--impl", "ours,hf")
    ours = [getattr(p.cfg, field) for p in both if p.impl == "ours"]
    peer = [getattr(p.cfg, field) for p in both if p.impl == "hf"]
    # ours: a row each way; the peer: one, with the default
    assert sorted(ours) == [False] * len(peer) + [True] * len(peer) and all(peer)


def test_overlap_optimizer_both_gives_ours_a_row_each_way_and_the_peer_one(tmp_path):
    args = bench_model.parse_args([*TINY, "--context-lengths", "16", "--mode", "train-step", "--impl", "ours,hf",
                                   "--overlap-optimizer", "both"])
    assert [(p.impl, p.overlap_optimizer) for p in bench_model.sweep_points(args)] == [
        ("ours", False), ("ours", True), ("hf", False)]
    rows = bench_model.main([*TINY, "--context-lengths", "16", "--mode", "train-step", "--overlap-optimizer",
                             "--out", str(tmp_path)])
    assert [r["overlap_optimizer"] for r in rows] == [True] and rows[0]["status"] == "ok"
    assert "opt-overlap" in (tmp_path / "results.md").read_text()


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
    (["--dtype", "fp16"], "unknown dtype 'fp16'; valid: fp32, bf16"),
    (["--mode", "backward"], "unknown mode 'backward'; valid: forward, forward-backward, train-step"),
    (["--context-lengths", "128,abc"], "'abc' is not an integer"),
    (["--context-lengths", "0"], "values must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--cuda-graph", "--mode", "forward"], "--cuda-graph captures the whole train step: use --mode train-step"),
    (["--cuda-graph", "--mode", "train-step", "--warmup", "2"], "--cuda-graph needs --warmup >= 3"),
    (["--cuda-graph", "--mode", "train-step", "--warmup", "3"], "--cuda-graph needs a CUDA device, got --device cpu"),
    (["--overlap-optimizer", "--mode", "forward"], "--overlap-optimizer steps the optimizer inside the backward"),
    (["--optim-state-dtype", "bf16", "--mode", "forward"], "--optim-state-dtype is the train step's optimizer"),
    (["--optim-state-dtype", "fp16", "--mode", "train-step"], "unknown optimizer state dtype 'fp16'"),
])
def test_bad_arguments_exit_with_a_message(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_model.parse_args([*TINY, *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_size_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--sizes", "small,giant"])
    err = capsys.readouterr().err
    assert "small, medium, large, xl, 2.7B" in err


def test_custom_size_needs_all_four_dims(capsys):
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--d-model", "64", "--n-heads", "4"])
    assert "missing --n-layers --d-ff" in capsys.readouterr().err
