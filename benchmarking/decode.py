"""Sampling speed: prefill and decode tokens/s of our model, Hugging Face `generate` as the peer, and the memory
bandwidth a decode step reaches.

A decode step at small batch reads every weight once, and each sequence's KV cache once, for one token per
sequence: it is bound by memory bandwidth. So beside tokens/s we report the bytes a step must read,
(weight bytes + KV-cache bytes read) / step time, against the GPU's measured copy bandwidth (`copy_bandwidth`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from benchmarking.timing import TimingStats, captured, summarize, synchronize, time_ms, time_stats_ms
from model import ModelConfig, TransformerLM
from model.generation import Decoder, for_inference


@functools.cache
def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (read + write counted), the practical ceiling of a
    memory-bound kernel; on the CPU, of a memcpy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=20, warmup=3).median_ms
    return 2 * src.nbytes / (ms * 1e-3)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a forward reads for the weights: every parameter but the embedding, of which a step gathers a row per
    token (negligible)."""
    embed = getattr(model, "embed", None)
    skip = {id(embed.weight)} if embed is not None else set()
    return sum(p.nbytes for p in model.parameters() if id(p) not in skip)


def cache_bytes_read(cfg: ModelConfig, batch: int, cache_len: int, dtype: torch.dtype) -> int:
    """K and V of every layer for `cache_len` positions of `batch` sequences: the key/value heads only (GQA), and a
    local layer's window only."""
    positions = sum(min(cache_len, cfg.layer_window(i) or cache_len) for i in range(cfg.n_layers))
    width = cfg.kv_heads * cfg.d_head
    return 2 * positions * batch * width * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class DecodeTiming:
    ms_per_step: float  # one decode step: a new token for each sequence of the batch
    ms_std: float  # sample std over blocks of steps
    tokens_per_s: float  # batch / step time
    bytes_per_step: int  # weights + the KV cache read
    bandwidth: float  # bytes_per_step / step time, bytes/s


def _timing(times_ms: list[float], batch: int, nbytes: int) -> DecodeTiming:
    stats = summarize(times_ms)
    ms = stats.mean_ms
    return DecodeTiming(ms, stats.std_ms, batch / (ms * 1e-3), nbytes, nbytes / (ms * 1e-3))


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                attn: str = "sdpa") -> TransformerLM:
    """A randomly initialised model for timing, built on `device` (no CPU init of a 2.7B model)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = TransformerLM(cfg, attn)
    return for_inference(model, dtype)


def time_prefill(model: TransformerLM, batch: int, prompt_len: int, steps: int = 5, warmup: int = 2,
                 hf: bool = False) -> TimingStats:
    """The prefill of `batch` prompts of `prompt_len` tokens (KV cache written, logits of the last position); with
    hf, the Hugging Face peer's forward over the prompts with its cache."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), device=device)
    if hf:
        from benchmarking.hf_llama import llama_from

        peer = llama_from(model).hf
        with torch.no_grad():
            return time_stats_ms(lambda: peer(input_ids=ids, use_cache=True), device, iters=steps, warmup=warmup)
    decoder = Decoder(model, batch, prompt_len)
    lengths = torch.full((batch,), prompt_len, device=device)
    return time_stats_ms(lambda: decoder.prefill(ids, lengths), device, iters=steps, warmup=warmup)


def time_decode(model: TransformerLM, batch: int, cache_len: int, compile: bool = True, steps: int = 50,
                warmup: int = 3, blocks: int = 5) -> DecodeTiming:
    """Decode steps with `cache_len` positions in the cache (greedy tokens after a random prompt; the cache grows
    by `steps`, counted at its mean length), timed in `blocks` blocks of steps / blocks steps each."""
    cfg = model.cfg
    if cache_len + warmup + steps + 1 > cfg.context_length:
        raise ValueError(f"cache {cache_len} + {warmup + steps} steps exceed the context ({cfg.context_length})")
    device = next(model.parameters()).device
    decoder = Decoder(model, batch, cache_len + warmup + steps + 1, compile=compile)
    ids = torch.randint(0, cfg.vocab_size, (batch, cache_len), device=device)
    tokens = decoder.prefill(ids, torch.full((batch,), cache_len, device=device)).argmax(-1)
    for _ in range(warmup):
        tokens = decoder.step(tokens).argmax(-1)
    per_block = max(1, steps // blocks)
    times = []
    for _ in range(blocks):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(per_block):
            tokens = decoder.step(tokens).argmax(-1)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3 / per_block)
    dtype = decoder.cache.dtype
    return _timing(times, batch, weight_bytes(model) + cache_bytes_read(cfg, batch, cache_len + steps // 2, dtype))


def time_hf_decode(model: TransformerLM, batch: int, cache_len: int, steps: int = 50) -> Optional[DecodeTiming]:
    """Hugging Face `generate` (greedy, static cache, its automatic torch.compile of the decode step) on the same
    weights (benchmarking/hf_llama.py maps them): (time of steps + 1 new tokens - time of 1) / steps."""
    from benchmarking.hf_llama import llama_from

    cfg = model.cfg
    device = next(model.parameters()).device
    hf = llama_from(model).hf
    hf.config.use_cache = hf.generation_config.use_cache = True
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.randint(0, cfg.vocab_size, (batch, cache_len), device=device)

    def run(new: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, cache_implementation="static")
        synchronize(device)
        return time.perf_counter() - start

    run(steps + 1)  # compiles and captures
    prefill = min(run(1) for _ in range(3))
    times = [(run(steps + 1) - prefill) * 1e3 / steps for _ in range(3)]
    dtype = next(hf.parameters()).dtype
    return _timing(times, batch, weight_bytes(model) + cache_bytes_read(cfg, batch, cache_len + steps // 2, dtype))


def time_attention_decode(name: str, batch: int, heads: int, cache_len: int, d_head: int, dtype: torch.dtype,
                          device: torch.device, kv_heads: Optional[int] = None,
                          window: Optional[int] = None, graph: bool = False) -> tuple[float, float, Optional[float]]:
    """(ms, bytes/s reading K and V, ms replayed from a CUDA graph with `graph`, else None) of one query per
    sequence and head against a full cache of `cache_len` with `kv_heads` heads (GQA; default `heads`), through the
    registry's decode path of backend `name`. With a window, only its last `window` positions are counted (what a
    backend that skips the rest reads: flash; the masking ones, naive and sdpa, read the whole cache)."""
    from attention import get_attention, graph_replay

    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, d_head, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads or heads, cache_len, d_head, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    cache_len_t = torch.full((batch,), cache_len, device=device)
    decode = get_attention(name).decode
    variant = {} if window is None else {"window": window}
    def step() -> torch.Tensor:
        return decode(q, k, v, cache_len_t, **variant)

    ms = time_ms(step, device).median_ms
    graph_ms = None
    if graph:
        with graph_replay():
            graph_ms = time_ms(captured(step, device), device).median_ms
    read = (k.nbytes + v.nbytes) * min(cache_len, window or cache_len) // cache_len
    return ms, read / (ms * 1e-3), graph_ms


def sampling_figures(mode: str, impl: str, cfg: ModelConfig, batch: int, cache_len: int, dtype: torch.dtype,
                     compile: bool, device: torch.device, steps: int, warmup: int, attn: str = "sdpa") -> dict:
    """bench_model.py's figures of a prefill or decode configuration: a prefill of `cache_len` prompt tokens per
    sequence, or decode steps against a cache of `cache_len`; impl "ours" or "hf" (the Hugging Face peer)."""
    model = build_model(replace(cfg, context_length=cache_len + warmup + steps + 1), dtype, device, attn=attn)
    if mode == "prefill":
        stats = time_prefill(model, batch, cache_len, steps, warmup, hf=impl == "hf")
        return {"total_ms_mean": stats.mean_ms, "total_ms_std": stats.std_ms,
                "tokens_per_s": batch * cache_len / (stats.mean_ms * 1e-3)}
    if impl == "hf":
        timing = time_hf_decode(model, batch, cache_len, steps)
    else:
        timing = time_decode(model, batch, cache_len, compile, steps, warmup)
    return {"total_ms_mean": timing.ms_per_step, "total_ms_std": timing.ms_std, "tokens_per_s": timing.tokens_per_s,
            "bandwidth_gbs": timing.bandwidth / 1e9, "bandwidth_fraction": timing.bandwidth / copy_bandwidth(device)}


DECODE_COLUMNS = ["backend", "batch", "heads", "kv_heads", "cache_len", "window", "d_head", "dtype", "status", "ms",
                  "gbs", "copy_fraction", "graph_ms", "graph_copy_fraction", "note"]


def attention_decode_rows(backends: list[str], batches: list[int], heads: int, cache_lens: list[int],
                          d_heads: list[int], dtype: torch.dtype, device: torch.device, kv_heads: Optional[int] = None,
                          window: Optional[int] = None, graph_timing: bool = False) -> list[dict]:
    """bench_attention.py --decode: one row per (backend, batch, cache length, d_head): the decode call's time, the
    GB/s it reads K and V at, and that over the copy bandwidth; a backend that cannot run a point says why.
    kv_heads: the cache's heads (GQA); window: each query reads only the last `window` positions; graph_timing:
    also the time replayed from a CUDA graph (no host time) and its GB/s over the copy bandwidth."""
    from attention import why_not_decode
    from benchmarking.oom import call_catching_oom, free_memory

    copy = copy_bandwidth(device) if device.type == "cuda" else None
    rows = []
    for batch in batches:
        for cache_len in cache_lens:
            for d in d_heads:
                # Expanded scalars: the shapes, dtype and device the checks look at, without the memory.
                zero = torch.zeros((), dtype=dtype, device=device)
                q, k = zero.expand(batch, heads, 1, d), zero.expand(batch, kv_heads or heads, cache_len, d)
                for name in backends:
                    row = {"backend": name, "batch": batch, "heads": heads, "kv_heads": kv_heads or heads,
                           "cache_len": cache_len, "window": window, "d_head": d,
                           "dtype": str(dtype).removeprefix("torch."), "status": "ok", "ms": None, "gbs": None,
                           "copy_fraction": None, "graph_ms": None, "graph_copy_fraction": None, "note": None}
                    reason = why_not_decode(name, q, k, k, cache_len, window=window)
                    if reason is not None:
                        row.update(status="unsupported", note=reason)
                        rows.append(row)
                        continue
                    try:
                        outcome = call_catching_oom(lambda: time_attention_decode(
                            name, batch, heads, cache_len, d, dtype, device, kv_heads, window, graph_timing),
                            label=name)
                    except Exception as e:  # noqa: BLE001 - one failing backend must not end the sweep
                        row.update(status="error", note=f"{type(e).__name__}: {e}".splitlines()[0][:200])
                    else:
                        if outcome.oom:
                            row.update(status="OOM", note=outcome.message)
                        else:
                            ms, bandwidth, graph_ms = outcome.value
                            row.update(ms=ms, gbs=bandwidth / 1e9,
                                       copy_fraction=None if copy is None else bandwidth / copy, graph_ms=graph_ms)
                            if graph_ms is not None and copy is not None:
                                row["graph_copy_fraction"] = bandwidth * ms / graph_ms / copy
                    free_memory()
                    rows.append(row)
    return rows
