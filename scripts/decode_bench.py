"""flash's decode attention against SDPA's cuDNN, FlashAttention-2 and memory-efficient kernels, bf16, on a CUDA GPU.

One query per sequence and head against a full KV cache, eager and replayed from a CUDA graph (GPU time without the
host's launches), beside the copy bandwidth of a tensor the cache's size: a decode step reads the cache once, so
flash's GB/s over the copy's is how near the memory bound it runs. SDPA gets the cache without a mask (it is full)
and enable_gqa for GQA; a kernel that refuses a point shows "-".

    python scripts/decode_bench.py                               # B1/B4/B32 x three head shapes x 2k/16k/64k
    python scripts/decode_bench.py --batches 1,4 --caches 16384
    python scripts/decode_bench.py --sweep                       # batch-1 launch settings, the best first

--sweep times flash's decode replayed from a CUDA graph at a few batch-1 points over a small grid of its launch
settings (attention/flash/decode/host.py: programs per SM, keys per tile, warps, pipeline stages), each against the
copy bandwidth, and prints the fastest per point beside the current settings.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention import get_attention, graph_replay  # noqa: E402
from attention.flash.decode import host as decode_host  # noqa: E402
from benchmarking.decode import copy_bandwidth  # noqa: E402
from benchmarking.timing import captured, time_ms  # noqa: E402

HEAD_SHAPES = [(32, 8, 128), (32, 32, 128), (16, 16, 64)]  # (heads, kv heads, d_head)
SDPA_KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION,
                "eff": SDPBackend.EFFICIENT_ATTENTION}
ITERS, WARMUP = 50, 5
HOST_CALLS = 200  # eager calls timed on the host alone (fewer than the launch queue holds)

SWEEP_POINTS = [(32, 8, 128, 16384), (32, 32, 128, 16384), (16, 16, 64, 65536)]  # batch 1
SWEEP_PROGRAMS_PER_SM = (1, 2, 4)
SWEEP_TILES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3)]  # (BLOCK_N, num_warps, num_stages)
SWEEP_KNOBS = ("PROGRAMS_PER_SM", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def eager_and_graph_us(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float]:
    """Median µs of fn called eagerly and of its replay from a CUDA graph."""
    eager = time_ms(fn, device, iters=ITERS, warmup=WARMUP).median_ms
    with graph_replay():
        replay = captured(fn, device)
    graph = time_ms(replay, device, iters=ITERS, warmup=WARMUP).median_ms
    return eager * 1e3, graph * 1e3


def host_us(fn: Callable[[], torch.Tensor]) -> float:
    """Mean µs of host time per eager call: HOST_CALLS calls queued without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def sdpa_call(kernel: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[Callable]:
    """The SDPA call on one kernel, or None where that kernel refuses the input."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

    def run() -> torch.Tensor:
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, **gqa)

    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return run


def point(batch: int, heads: int, kv_heads: int, d: int, cache: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, kv_heads, cache, d, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    cache_len = torch.full((batch,), cache, device=device)
    decode = get_attention("flash").decode
    row = {"flash": eager_and_graph_us(lambda: decode(q, k, v, cache_len), device),
           "host": host_us(lambda: decode(q, k, v, cache_len))}
    out = decode(q, k, v, cache_len)
    row["maxdiff"] = None
    for name, kernel in SDPA_KERNELS.items():
        run = sdpa_call(kernel, q, k, v)
        row[name] = None if run is None else eager_and_graph_us(run, device)
        if run is not None and row["maxdiff"] is None:
            row["maxdiff"] = (run().float() - out.float()).abs().max().item()
    nbytes = k.nbytes + v.nbytes
    row["flash_gbs"] = nbytes / (row["flash"][1] * 1e-6) / 1e9
    row["copy_gbs"] = copy_bandwidth(device, nbytes) / 1e9
    return row


def _us(pair: Optional[tuple[float, float]], i: int) -> str:
    return "-" if pair is None else f"{pair[i]:.1f}"


def _ratio(row: dict, i: int) -> str:
    return "-" if row["cudnn"] is None else f"{row['cudnn'][i] / row['flash'][i]:.2f}"


@contextlib.contextmanager
def decode_settings(values: tuple[int, ...]):
    """Inside: flash's decode launches with SWEEP_KNOBS set to `values` (the kept plans are dropped on the way in
    and out, so every call resolves its launches again)."""
    saved = tuple(getattr(decode_host, name) for name in SWEEP_KNOBS)
    try:
        for name, value in zip(SWEEP_KNOBS, values):
            setattr(decode_host, name, value)
        decode_host._plans.clear()
        yield
    finally:
        for name, value in zip(SWEEP_KNOBS, saved):
            setattr(decode_host, name, value)
        decode_host._plans.clear()


def graph_us(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    with graph_replay():
        replay = captured(fn, device)
    return time_ms(replay, device, iters=ITERS, warmup=WARMUP).median_ms * 1e3


def sweep_point(heads: int, kv_heads: int, d: int, cache: int, device: torch.device) -> dict[tuple, float]:
    """One batch-1 point over the grid of settings: prints the current ones, then the five fastest others (diff: the
    largest difference from the current settings' output); returns µs by settings."""
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, heads, 1, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, kv_heads, cache, d, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    cache_len = torch.full((1,), cache, device=device)
    decode = get_attention("flash").decode
    current = tuple(getattr(decode_host, name) for name in SWEEP_KNOBS)
    expected = decode(q, k, v, cache_len)
    copy = copy_bandwidth(device, k.nbytes + v.nbytes) / 1e9
    timed = {}
    for pps, tiles in itertools.product(SWEEP_PROGRAMS_PER_SM, SWEEP_TILES):
        with decode_settings((pps, *tiles)):
            diff = (decode(q, k, v, cache_len).float() - expected.float()).abs().max().item()
            timed[(pps, *tiles)] = (graph_us(lambda: decode(q, k, v, cache_len), device), diff)
    if current not in timed:
        timed[current] = (graph_us(lambda: decode(q, k, v, cache_len), device), 0.0)
    print(f"B1 H{heads} KV{kv_heads} D{d} cache {cache}: copy {copy:.0f} GB/s", flush=True)
    best = [c for c in sorted(timed, key=lambda c: timed[c][0]) if c != current][:5]
    for values in [current] + best:
        us, diff = timed[values]
        gbs = (k.nbytes + v.nbytes) / (us * 1e-6) / 1e9
        label = "current" if values == current else "       "
        knobs = " ".join(f"{name}={value}" for name, value in zip(SWEEP_KNOBS, values))
        print(f"  {label} {knobs:<58} {us:>7.1f} µs {gbs / copy:>5.0%} of copy  diff {diff:.1e}", flush=True)
    return {values: us for values, (us, _) in timed.items()}


def sweep(device: torch.device) -> None:
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; flash decode replayed from a CUDA "
          f"graph, bf16, batch 1")
    points = []
    for heads, kv_heads, d, cache in SWEEP_POINTS:
        points.append(sweep_point(heads, kv_heads, d, cache, device))
        torch.cuda.empty_cache()
    # Over all points: the geometric mean of each setting's time over the fastest time at that point.
    common = set.intersection(*(set(p) for p in points))
    score = {c: math.prod(p[c] / min(p.values()) for p in points) ** (1 / len(points)) for c in common}
    for values in sorted(score, key=score.get)[:5]:
        knobs = " ".join(f"{name}={value}" for name, value in zip(SWEEP_KNOBS, values))
        print(f"overall {knobs:<58} {score[values]:.3f}x the fastest at each point", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=_ints, default=[1, 4, 32])
    p.add_argument("--caches", type=_ints, default=[2048, 16384, 65536])
    p.add_argument("--sweep", action="store_true", help="time flash's batch-1 launch settings instead")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    if args.sweep:
        sweep(device)
        return
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; µs eager / µs graph-replayed; "
          "ratio = cuDNN / flash; GB/s of K+V read by flash (graph) and by a copy of that size; host = µs of host "
          "time per eager flash call")
    head = (f"{'B':>3} {'H':>3} {'KV':>3} {'D':>4} {'cache':>6} | {'flash':>13} | {'cudnn':>13} | {'fa2':>13} | "
            f"{'eff':>13} | {'ratio e/g':>11} | {'flash GB/s':>10} {'copy GB/s':>9} {'frac':>5} | {'host':>5} | maxdiff")
    print(head)
    print("-" * len(head))
    for batch in args.batches:
        for heads, kv_heads, d in HEAD_SHAPES:
            for cache in args.caches:
                row = point(batch, heads, kv_heads, d, cache, device)
                cells = [f"{_us(row[n], 0):>6}/{_us(row[n], 1):<6}" for n in ("flash", "cudnn", "fa2", "eff")]
                diff = "-" if row["maxdiff"] is None else f"{row['maxdiff']:.1e}"
                print(f"{batch:>3} {heads:>3} {kv_heads:>3} {d:>4} {cache:>6} | " + " | ".join(cells)
                      + f" | {_ratio(row, 0):>5}/{_ratio(row, 1):<5} | {row['flash_gbs']:>10.0f} "
                      f"{row['copy_gbs']:>9.0f} {row['flash_gbs'] / row['copy_gbs']:>5.0%} | {row['host']:>5.1f} | {diff}",
                      flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
