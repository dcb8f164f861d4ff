"""flash's decode attention against SDPA's cuDNN, FlashAttention-2 and memory-efficient kernels, bf16, on a CUDA GPU.

One query per sequence and head against a full KV cache, eager and replayed from a CUDA graph (GPU time without the
host's launches), beside the copy bandwidth of a tensor the cache's size: a decode step reads the cache once, so
flash's GB/s over the copy's is how near the memory bound it runs. SDPA gets the cache without a mask (it is full)
and enable_gqa for GQA; a kernel that refuses a point shows "-".

    python scripts/decode_bench.py                               # B1/B4/B32 x three head shapes x 2k/16k/64k
    python scripts/decode_bench.py --batches 1,4 --caches 16384 --head-shapes 32x8x128,8x2x256
    python scripts/decode_bench.py --sweep                       # tiles and split counts at the same points
    python scripts/decode_bench.py --tiles 64x4x3 --head-shapes 16x16x64   # the default tiles against others

--sweep times flash's decode replayed from a CUDA graph at every point over a grid of tiles (keys per tile, warps,
pipeline stages) and split counts, and prints each point's default choice (attention/flash/decode/tiles.py) against
the fastest setting and cuDNN, then per head dim how near each tile shape comes to the fastest with its best split
count.

--tiles times the default choice against the given tiles (keys per tile x warps x pipeline stages), each at the
default split count, replayed from a CUDA graph in ROUNDS rounds taking turns, with cuDNN: medians, and per tile shape
its geometric mean over the points.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention import get_attention, graph_replay  # noqa: E402
from attention.flash.decode import host as decode_host  # noqa: E402
from attention.flash.decode.tiles import DecodeTiles, tiles_for  # noqa: E402
from benchmarking.decode import copy_bandwidth  # noqa: E402
from benchmarking.timing import captured, time_ms  # noqa: E402

# (heads, kv heads, d_head): Llama-3 8B's, Llama-2 7B's, GPT-2 medium's
HEAD_SHAPES = [(32, 8, 128), (32, 32, 128), (16, 16, 64)]
SDPA_KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION,
                "eff": SDPBackend.EFFICIENT_ATTENTION}
ITERS, WARMUP = 50, 5
HOST_CALLS = 200  # eager calls timed on the host alone (fewer than the launch queue holds)

SWEEP_TILES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
               (128, 4, 4)]  # (keys per tile, warps, pipeline stages)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
ROUNDS = 3  # --tiles: rounds taking turns


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _head_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]
    if any(len(shape) != 3 or min(shape) < 1 or shape[0] % shape[1] for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: each shape is HxKVxD with H a multiple of KV, e.g. 32x8x128")
    return shapes


def _tile_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]
    if any(len(shape) != 3 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: each is KEYSxWARPSxSTAGES, e.g. 64x4x3")
    return shapes


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


def step_inputs(batch: int, heads: int, kv_heads: int, d: int, cache: int, device: torch.device) -> tuple:
    """q (batch, heads, 1, d), a full bf16 cache (batch, kv_heads, cache, d) of K and V, and its lengths."""
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, kv_heads, cache, d, device=device, dtype=torch.bfloat16, generator=gen)
    return q, k, torch.randn_like(k), torch.full((batch,), cache, device=device)


def point(batch: int, heads: int, kv_heads: int, d: int, cache: int, device: torch.device) -> dict:
    q, k, v, cache_len = step_inputs(batch, heads, kv_heads, d, cache, device)
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


def graph_us(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    with graph_replay():
        replay = captured(fn, device)
    return time_ms(replay, device, iters=ITERS, warmup=WARMUP).median_ms * 1e3


def sweep_point(batch: int, heads: int, kv_heads: int, d: int, cache: int, device: torch.device) -> dict:
    """One point over SWEEP_TILES x SWEEP_SPLITS, replayed from a CUDA graph: µs by (tiles, splits), with the default
    choice's µs and cuDNN's. Every setting's output is held to the default's."""
    q, k, v, cache_len = step_inputs(batch, heads, kv_heads, d, cache, device)
    decode = get_attention("flash").decode
    expected = decode(q, k, v, cache_len).float()
    cudnn = sdpa_call(SDPA_KERNELS["cudnn"], q, k, v)
    row = {"cudnn": None if cudnn is None else graph_us(cudnn, device),
           "default": graph_us(lambda: decode(q, k, v, cache_len), device), "timed": {}}
    too_big = set()  # tiles that do not fit the GPU at this head dim
    for (block_n, warps, stages), splits in itertools.product(SWEEP_TILES, SWEEP_SPLITS):
        if splits * block_n > cache or (block_n, warps, stages) in too_big:  # more chunks than tiles of keys
            continue
        tiles = DecodeTiles(block_n, warps, stages, 1)

        def run() -> torch.Tensor:
            return decode_host.decode_triton(q, k, v, cache_len, d ** -0.5, num_splits=splits, tiles=tiles)

        try:
            torch.testing.assert_close(run().float(), expected, atol=2e-2, rtol=2e-2)
        except triton.runtime.errors.OutOfResources:  # e.g. 128-key tiles of d 256 in three stages
            too_big.add((block_n, warps, stages))
            continue
        row["timed"][(block_n, warps, stages), splits] = graph_us(run, device)
    return row


def sweep(batches: list[int], head_shapes: list[tuple[int, int, int]], caches: list[int],
          device: torch.device) -> None:
    """Prints each point's default against its fastest setting, then per head dim how near the default choice and
    each tile shape with its best split count come to the fastest."""
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; flash decode replayed from a CUDA "
          "graph, bf16, one new token, µs; tiles = (keys per tile, warps, stages)")
    near: dict[tuple, list[float]] = {}  # (d, tiles) -> each point's best time with those tiles over the fastest
    for batch, (heads, kv_heads, d), cache in itertools.product(batches, head_shapes, caches):
        row = sweep_point(batch, heads, kv_heads, d, cache, device)
        if not row["timed"]:
            print(f"B{batch} H{heads} KV{kv_heads} D{d} cache {cache}: no setting of the grid runs here", flush=True)
            continue
        fastest = min(row["timed"], key=row["timed"].get)
        best_us = row["timed"][fastest]
        cudnn = "refused" if row["cudnn"] is None else (
            f"{row['cudnn']:.1f} (cuDNN / default {row['cudnn'] / row['default']:.2f})")
        print(f"B{batch} H{heads} KV{kv_heads} D{d} cache {cache}: default {row['default']:.1f} "
              f"({row['default'] / best_us:.2f}x the fastest), fastest {best_us:.1f} tiles {fastest[0]} splits "
              f"{fastest[1]}, cuDNN {cudnn}", flush=True)
        near.setdefault((d, "default"), []).append(row["default"] / best_us)
        for tiles in SWEEP_TILES:
            times = [us for (t, _), us in row["timed"].items() if t == tiles]
            if times:  # none where the tiles do not fit
                near.setdefault((d, tiles), []).append(min(times) / best_us)
        torch.cuda.empty_cache()
    for (d, tiles), ratios in sorted(near.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        label = "the default choice" if tiles == "default" else f"tiles {tiles}, best split count"
        print(f"d {d} {label}: {geo:.3f}x the fastest (geometric mean), worst {max(ratios):.3f}x")


def compare_tiles(batches: list[int], head_shapes: list[tuple[int, int, int]], caches: list[int],
                  shapes: list[tuple[int, int, int]], device: torch.device) -> None:
    """Prints, per point, the default choice's µs replayed from a CUDA graph against each of `shapes` at the default
    split count, and cuDNN's (medians of ROUNDS rounds taking turns); then each shape's geometric mean over the
    points, as its time over the default's."""
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; flash decode replayed from a CUDA "
          f"graph, bf16, one new token, µs, medians of {ROUNDS} rounds taking turns; tiles = keys x warps x stages, "
          "each at the default split count")
    names = ["default", *(f"{n}x{w}x{s}" for n, w, s in shapes), "cudnn"]
    print(f"{'B':>3} {'H':>3} {'KV':>3} {'D':>4} {'cache':>6} | " + " | ".join(f"{n:>9}" for n in names))
    over_default: dict[str, list[float]] = {n: [] for n in names[1:-1]}
    for batch, (heads, kv_heads, d), cache in itertools.product(batches, head_shapes, caches):
        q, k, v, cache_len = step_inputs(batch, heads, kv_heads, d, cache, device)
        default = decode_host.decode_triton(q, k, v, cache_len, d ** -0.5)
        per_sm = tiles_for(triton.next_power_of_2(d)).programs_per_sm  # the default's: so is the split count
        calls = {"default": lambda: decode_host.decode_triton(q, k, v, cache_len, d ** -0.5)}
        for name, (n, w, s) in zip(names[1:-1], shapes):
            calls[name] = functools.partial(decode_host.decode_triton, q, k, v, cache_len, d ** -0.5,
                                            tiles=DecodeTiles(n, w, s, per_sm))
            torch.testing.assert_close(calls[name]().float(), default.float(), atol=2e-2, rtol=2e-2)
        cudnn = sdpa_call(SDPA_KERNELS["cudnn"], q, k, v)
        if cudnn is not None:
            calls["cudnn"] = cudnn
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, fn in calls.items():
                times[name].append(graph_us(fn, device))
        med = {name: statistics.median(t) for name, t in times.items()}
        for name in over_default:
            over_default[name].append(med[name] / med["default"])
        print(f"{batch:>3} {heads:>3} {kv_heads:>3} {d:>4} {cache:>6} | "
              + " | ".join(f"{med[n]:>9.1f}" if n in med else f"{'-':>9}" for n in names), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    for name, ratios in over_default.items():
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{name}: {geo:.3f}x the default's time (geometric mean), {min(ratios):.3f}x-{max(ratios):.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=_ints, default=[1, 4, 32])
    p.add_argument("--caches", type=_ints, default=[2048, 16384, 65536])
    p.add_argument("--head-shapes", type=_head_shapes, default=HEAD_SHAPES, metavar="HxKVxD,...",
                   help="query heads x cache heads x head dim, e.g. 32x8x128")
    p.add_argument("--sweep", action="store_true", help="time flash's tiles and split counts at the points instead")
    p.add_argument("--tiles", type=_tile_shapes, metavar="KEYSxWARPSxSTAGES,...",
                   help="time the default choice against these tiles at the points instead, e.g. 64x4x3")
    args = p.parse_args()
    if args.sweep and args.tiles:
        p.error("--sweep and --tiles: one at a time")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    if args.sweep:
        sweep(args.batches, args.head_shapes, args.caches, device)
        return
    if args.tiles:
        compare_tiles(args.batches, args.head_shapes, args.caches, args.tiles, device)
        return
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; µs eager / µs graph-replayed; "
          "ratio = cuDNN / flash; GB/s of K+V read by flash (graph) and by a copy of that size; host = µs of host "
          "time per eager flash call")
    head = (f"{'B':>3} {'H':>3} {'KV':>3} {'D':>4} {'cache':>6} | {'flash':>13} | {'cudnn':>13} | {'fa2':>13} | "
            f"{'eff':>13} | {'ratio e/g':>11} | {'flash GB/s':>10} {'copy GB/s':>9} {'frac':>5} | {'host':>5} | maxdiff")
    print(head)
    print("-" * len(head))
    for batch in args.batches:
        for heads, kv_heads, d in args.head_shapes:
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
