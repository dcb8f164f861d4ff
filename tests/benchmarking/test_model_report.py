"""bench_model.py's console line and grouping of rows (benchmarking.model_report)."""

from benchmarking.model_report import summary_line, variant, variants

ROW = {"status": "ok", "impl": "ours", "attn": "flash", "dtype": "bf16", "compile": True, "mode": "train-step",
       "cuda_graph": False, "overlap_optimizer": True, "forward_ms_mean": 1.0, "forward_ms_std": 0.1,
       "backward_ms_mean": 2.0, "backward_ms_std": 0.2, "optimizer_ms_mean": None, "total_ms_mean": 3.5,
       "total_ms_std": 0.25, "tokens_per_s": 1234.4, "mfu": 0.4, "peak_mem_gib": None}


def test_summary_line_lists_the_timed_phases_and_the_figures_present():
    line = summary_line(ROW, "small T=32")
    assert line == ("small T=32: forward 1.00±0.10 ms, backward 2.00±0.20 ms, total 3.50±0.25 ms, 1234 tok/s, "
                    "MFU 40.0%")


def test_summary_line_of_a_failed_row_gives_its_status_and_reason():
    assert summary_line({"status": "OOM", "message": "CUDA out of memory"}, "xl") == "xl: OOM (CUDA out of memory)"


def test_rows_group_by_everything_but_size_and_context():
    peer = {**ROW, "impl": "hf", "overlap_optimizer": False}
    assert variant(ROW) == "flash bf16 compile=on train-step opt-overlap"
    assert variant(peer) == "hf-llama bf16 compile=on train-step"
    groups = variants([ROW, {**ROW, "context_length": 64}, peer])
    assert [len(g) for g in groups.values()] == [2, 1]


def test_a_variant_names_its_optimizer_unless_adamw_and_its_float8_recipe():
    assert variant({**ROW, "optimizer": "adamw"}) == "flash bf16 compile=on train-step opt-overlap"
    assert variant({**ROW, "optimizer": "adamw-bf16", "fp8": "rowwise"}) == \
        "flash bf16 compile=on train-step opt-overlap fp8=rowwise adamw-bf16"
    groups = variants([ROW, {**ROW, "optimizer": "adamw-bf16"}])
    assert [len(g) for g in groups.values()] == [1, 1]
