"""Sampling benchmarks on the CPU: the Hugging Face peer computes our model's function, and the timings run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarking.decode import cache_bytes_read, copy_bandwidth, time_decode, time_prefill, weight_bytes
from model import ModelConfig, TransformerLM
from model.generation import Sampling, generate

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=100, context_length=64)


def model(cfg: ModelConfig = CFG) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(cfg, "sdpa").eval()


@pytest.mark.parametrize("n_kv_heads", [pytest.param(None, marks=pytest.mark.slow), 2], ids=["mha", "gqa"])
def test_the_hf_peer_has_our_weights(n_kv_heads):
    pytest.importorskip("transformers")
    from benchmarking.hf_llama import llama_from

    ours = model(dataclasses.replace(CFG, n_kv_heads=n_kv_heads))
    ids = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(llama_from(ours)(ids), ours(ids), atol=1e-4, rtol=1e-4)


def test_hf_generate_continues_as_we_do():
    pytest.importorskip("transformers")
    from benchmarking.hf_llama import llama_from

    ours = model()
    hf = llama_from(ours).hf
    hf.generation_config.eos_token_id = None
    prompt = [5, 17, 3, 99, 42]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, use_cache=True,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, [prompt], 12, Sampling(temperature=0)).tokens[0] == theirs


def test_timings_run_and_count_bytes():
    m = model()
    t = time_decode(m, batch=2, cache_len=16, compile=False, steps=4, warmup=1)
    assert t.tokens_per_s > 0 and t.bandwidth == pytest.approx(t.bytes_per_step / (t.ms_per_step * 1e-3))
    assert t.bytes_per_step == weight_bytes(m) + cache_bytes_read(CFG, 2, 18, torch.float32)
    assert weight_bytes(m) == 4 * (m.num_params() - 100 * 64)
    assert time_prefill(m, batch=2, prompt_len=16, steps=2, warmup=1).mean_ms > 0
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20) > 0


@pytest.mark.slow  # bench_model.py end to end
def test_bench_model_prefill_and_decode_modes(tmp_path):
    import bench_model

    rows = bench_model.main(["--sizes", "custom", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff",
                             "128", "--context-lengths", "32", "--mode", "prefill,decode", "--batch-size", "2",
                             "--steps", "5", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path)])
    prefill, decode = rows
    assert prefill["status"] == decode["status"] == "ok", rows
    assert prefill["tokens_per_s"] == pytest.approx(2 * 32 / (prefill["total_ms_mean"] * 1e-3))
    assert decode["tokens_per_s"] == pytest.approx(2 / (decode["total_ms_mean"] * 1e-3))
    assert prefill["bandwidth_gbs"] is None and decode["bandwidth_gbs"] > 0 and decode["bandwidth_fraction"] > 0


@pytest.mark.slow  # bench_attention.py end to end (the one with GQA and a window stays in the fast set)
def test_bench_attention_decode_points(tmp_path):
    import bench_attention

    result = bench_attention.main(["--decode", "1,2", "--seq-lens", "64", "--heads", "2", "--d-heads", "16",
                                   "--dtype", "fp32", "--device", "cpu", "--backends", "naive,sdpa,sdpa-flash",
                                   "--iters", "2", "--warmup", "1", "--out", str(tmp_path)])
    rows = {(r["backend"], r["batch"]): r for r in result.rows}
    assert len(rows) == 6 and (tmp_path / "decode.md").exists() and (tmp_path / "decode.csv").exists()
    assert rows[("sdpa", 2)]["status"] == "ok" and rows[("sdpa", 2)]["gbs"] > 0
    assert rows[("sdpa-flash", 1)]["status"] == "unsupported"


def test_bench_attention_decode_points_with_gqa_and_a_window(tmp_path):
    import bench_attention

    result = bench_attention.main(["--decode", "1", "--seq-lens", "64", "--heads", "4", "--kv-heads", "1",
                                   "--window", "16", "--d-heads", "16", "--dtype", "fp32", "--device", "cpu",
                                   "--backends", "naive,sdpa,flex", "--iters", "2", "--warmup", "1", "--out",
                                   str(tmp_path)])
    rows = {r["backend"]: r for r in result.rows}
    assert rows["naive"]["status"] == rows["sdpa"]["status"] == "ok"
    assert (rows["sdpa"]["kv_heads"], rows["sdpa"]["window"]) == (1, 16)
    # The bytes counted are the window's of the one cache head: 2 x 16 positions x 16 dims x 4 bytes.
    assert rows["sdpa"]["gbs"] == pytest.approx(2 * 16 * 16 * 4 / (rows["sdpa"]["ms"] * 1e-3) / 1e9)
    assert rows["flex"]["status"] == "unsupported"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_bench_attention_decode_points_replayed_from_a_graph(tmp_path):
    import bench_attention

    result = bench_attention.main(["--decode", "1", "--seq-lens", "4096", "--heads", "8", "--kv-heads", "2",
                                   "--d-heads", "64", "--backends", "flash,sdpa", "--iters", "5", "--warmup", "1",
                                   "--graph-timing", "--out", str(tmp_path)])
    for row in result.rows:
        assert row["status"] == "ok" and 0 < row["graph_ms"] and 0 < row["graph_copy_fraction"], row
        assert row["graph_copy_fraction"] == pytest.approx(row["copy_fraction"] * row["ms"] / row["graph_ms"])


def test_cache_bytes_count_the_key_value_heads_and_the_windows():
    cfg = dataclasses.replace(CFG, n_kv_heads=2, window=4, window_pattern="LG")
    d_head = cfg.d_model // cfg.n_heads
    # The local layer reads its last 4 positions, the global one all 16; each of 2 heads.
    assert cache_bytes_read(cfg, 3, 16, torch.bfloat16) == 2 * (4 + 16) * 3 * 2 * d_head * 2
