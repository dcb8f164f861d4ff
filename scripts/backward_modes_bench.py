"""flash's two backward modes against SDPA's cuDNN on a Hopper GPU, bf16, the Hopper kernels at every size,
triton.testing.do_bench medians, every backend on the same inputs: fused (the dK/dV kernel adds dQ with TMA
reductions) and deterministic (dK/dV and dQ kernels side by side). Each line names the mode flash picks by default
where determinism is not asked for (hopper/inputs.py, FUSED_MIN).

    python scripts/backward_modes_bench.py            # eager forward+backward and backward alone, long sequences
    python scripts/backward_modes_bench.py --graphed  # forward+backward replayed from CUDA graphs, three rounds
                                                      # taking turns, around FUSED_MIN's bounds
    python scripts/backward_modes_bench.py --gqa      # the same for GQA: both modes with a dK/dV program per
                                                      # query head and per key/value head, around
                                                      # QUERY_HEAD_PROGRAMS_MIN's bounds
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention import graph_replay  # noqa: E402
from attention.flash import dispatch  # noqa: E402
from attention.flash.api import FlashAttention  # noqa: E402
from attention.flash.common import sm_count  # noqa: E402
from attention.flash.hopper import inputs as hopper_inputs  # noqa: E402
from benchmarking.timing import captured  # noqa: E402

# (batch, heads, kv heads, seq, d_head, causal)
SHAPES = [(1, 16, 16, 16384, 64, True), (1, 16, 16, 4096, 64, True), (16, 12, 12, 1024, 64, True),
          (4, 20, 20, 1024, 64, True), (2, 16, 16, 8192, 64, False), (8, 16, 4, 4096, 64, True),
          (2, 16, 16, 8192, 128, True), (8, 16, 16, 2048, 128, True), (4, 16, 16, 2048, 128, True),
          (2, 16, 16, 8192, 128, False), (8, 16, 4, 4096, 128, True), (1, 64, 8, 8192, 128, True),
          (1, 32, 32, 32768, 128, True)]
# Causal, short sequences and few dK/dV programs (B * KV * seq / 128), MHA and GQA: where the modes trade places.
GRAPHED_SHAPES = [(8, 32, 32, 512, 128, True), (16, 32, 32, 512, 128, True), (4, 16, 16, 1024, 128, True),
                  (8, 16, 16, 1024, 128, True), (16, 12, 12, 1024, 128, True), (8, 16, 4, 1024, 128, True),
                  (8, 16, 16, 1536, 128, True), (4, 16, 16, 2048, 128, True), (8, 16, 16, 2048, 128, True),
                  (2, 8, 8, 4096, 128, True), (2, 16, 16, 4096, 128, True), (1, 64, 8, 4096, 128, True),
                  (4, 32, 8, 4096, 128, True), (1, 8, 8, 8192, 128, True), (1, 16, 16, 8192, 128, True),
                  (1, 32, 4, 8192, 128, True), (1, 32, 8, 8192, 128, True), (1, 64, 8, 8192, 128, True),
                  (2, 64, 8, 8192, 128, True), (1, 4, 4, 16384, 128, True), (8, 32, 32, 512, 64, True),
                  (4, 20, 20, 1024, 64, True), (16, 12, 12, 1024, 64, True), (2, 16, 16, 2048, 64, True),
                  (1, 16, 16, 4096, 64, True), (1, 32, 4, 8192, 64, True), (1, 64, 8, 8192, 64, True)]
# GQA, causal: groups of 2-16 query heads, 2048-16384 keys, d 64 and 128, around QUERY_HEAD_PROGRAMS_MIN.
GQA_SHAPES = [(1, 64, 8, 8192, 128, True), (1, 32, 4, 8192, 128, True), (2, 64, 8, 8192, 128, True),
              (1, 32, 2, 8192, 128, True), (1, 64, 4, 8192, 128, True), (2, 32, 2, 8192, 128, True),
              (1, 128, 8, 8192, 128, True), (1, 32, 8, 8192, 128, True), (1, 32, 2, 16384, 128, True),
              (1, 32, 8, 16384, 128, True), (1, 32, 16, 16384, 128, True), (1, 64, 8, 4096, 128, True),
              (2, 64, 8, 4096, 128, True), (1, 64, 4, 4096, 128, True), (1, 32, 2, 4096, 128, True),
              (8, 16, 4, 4096, 128, True), (1, 64, 8, 2048, 128, True), (1, 32, 2, 2048, 128, True),
              (1, 32, 4, 8192, 64, True), (1, 64, 8, 8192, 64, True), (1, 32, 2, 8192, 64, True),
              (1, 32, 4, 4096, 64, True), (1, 16, 4, 16384, 64, True), (8, 16, 4, 4096, 64, True)]
MODES = hopper_inputs.MODES
QUERY_HEAD_PROGRAMS = {"query-head": hopper_inputs.QUERY_HEAD_PROGRAMS_AT_EVERY_SIZE,  # the dK/dV programs, forced
                       "kv-head": hopper_inputs.QUERY_HEAD_PROGRAMS_NEVER}


def times_ms(attend, q, k, v, do) -> tuple[float, float]:
    """(forward+backward, backward alone) of attend(q, k, v)."""
    def step():
        attend(q, k, v).backward(do)

    total = do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v])
    out = attend(q, k, v)
    backward = do_bench(lambda: out.backward(do, retain_graph=True), warmup=25, rep=200, grad_to_none=[q, k, v])
    return total, backward


def inputs(b: int, h: int, kv: int, n: int, d: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for heads in (h, kv, kv))
    return q, k, v, torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)


def attends(causal: bool, scale: float, gqa: bool) -> dict:
    """flash in each mode and cuDNN, as functions of (q, k, v)."""
    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    flash = {mode: (lambda q, k, v, mode=mode: FlashAttention.apply(q, k, v, causal, scale, None, None, None,
                                                                     mode == "deterministic")) for mode in MODES}
    return {**flash, "cudnn": cudnn}


def default_modes(shapes: list[tuple]) -> dict[tuple, str]:
    """The backward flash runs by default (FUSED_MIN as it stands) at each shape."""
    sms = sm_count(torch.cuda.current_device())
    return {(b, h, kv, n, d, causal): "deterministic" if hopper_inputs.fused_backward_problem(b, h, kv, n, d, sms)
            else "fused" for b, h, kv, n, d, causal in shapes}


def eager(picks: dict[tuple, str]) -> None:
    print("ms forward+backward / backward alone, eager; ratio = cuDNN's time / flash's")
    for b, h, kv, n, d, causal in SHAPES:
        q, k, v, do = inputs(b, h, kv, n, d)
        rows = {name: times_ms(fn, q, k, v, do) for name, fn in attends(causal, d ** -0.5, kv != h).items()}
        flop = 4 * b * h * n * n * d * (0.5 if causal else 1) * 2.5
        cells = " | ".join(f"{name} {t:.3f} / {bw:.3f}" for name, (t, bw) in rows.items())
        ratios = " ".join(f"{mode} {rows['cudnn'][0] / rows[mode][0]:.3f} / {rows['cudnn'][1] / rows[mode][1]:.3f}"
                          for mode in MODES)
        print(f"B{b} H{h} KV{kv} N{n} D{d} {'causal' if causal else 'full'} [default {picks[b, h, kv, n, d, causal]}]"
              f": {cells} | ratio {ratios} | fused backward {flop / rows['fused'][1] / 1e9:.0f} TFLOP/s", flush=True)


def _replays(attend: dict, q, k, v, do, programs: Optional[dict] = None) -> dict:
    """A CUDA-graph replay of forward+backward for each of `attend`'s functions; programs: QUERY_HEAD_PROGRAMS_MIN
    in force while they are captured (flash's plans are made on the first call of a signature: none is kept)."""
    replays = {}
    for name, fn in attend.items():
        if programs is not None:
            hopper_inputs.QUERY_HEAD_PROGRAMS_MIN = programs
            dispatch._plans.clear()
        with graph_replay():
            replays[name] = captured(lambda fn=fn: fn(q, k, v).backward(do), "cuda", grad_to_none=[q, k, v])
    return replays


def _medians(replays: dict, rounds: int) -> dict[str, float]:
    """Median ms of each replay over `rounds` rounds taking turns."""
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(do_bench(replay, warmup=10, rep=100))
    return {name: statistics.median(t) for name, t in times.items()}


def graphed(picks: dict[tuple, str], rounds: int = 3) -> None:
    print("ms forward+backward replayed from a CUDA graph, median of 3 rounds; ratio = cuDNN's time / flash's")
    for b, h, kv, n, d, causal in GRAPHED_SHAPES:
        q, k, v, do = inputs(b, h, kv, n, d)
        ms = _medians(_replays(attends(causal, d ** -0.5, kv != h), q, k, v, do), rounds)
        pick = picks[b, h, kv, n, d, causal]
        faster = min(MODES, key=ms.get)
        programs = hopper_inputs.fused_dkdv_programs(b, h, kv, n, d, sm_count(torch.cuda.current_device()))
        print(f"B{b} H{h} KV{kv} N{n} D{d} ({programs} dK/dV programs): "
              + " | ".join(f"{name} {t:.4f}" for name, t in ms.items())
              + f" | ratio fused {ms['cudnn'] / ms['fused']:.3f} deterministic {ms['cudnn'] / ms['deterministic']:.3f}"
              + f" | default {pick}, {'the faster' if pick == faster else 'the slower'} by "
              + f"{max(ms[m] for m in MODES) / min(ms[m] for m in MODES) - 1:.1%}", flush=True)


def gqa(picks: dict[tuple, str], rounds: int = 3) -> None:
    rule = dict(hopper_inputs.QUERY_HEAD_PROGRAMS_MIN)
    print("ms forward+backward replayed from a CUDA graph, median of 3 rounds taking turns; each mode with a dK/dV "
          "program per query head or per key/value head; ratio = cuDNN's time / the faster of each mode's")
    for b, h, kv, n, d, causal in GQA_SHAPES:
        q, k, v, do = inputs(b, h, kv, n, d)
        attend = attends(causal, d ** -0.5, True)
        replays = {}
        for programs, setting in QUERY_HEAD_PROGRAMS.items():
            for mode in MODES:
                replays[f"{mode}, {programs}"] = _replays({mode: attend[mode]}, q, k, v, do, setting)[mode]
        hopper_inputs.QUERY_HEAD_PROGRAMS_MIN = rule
        replays.update(_replays({"cudnn": attend["cudnn"]}, q, k, v, do))
        ms = _medians(replays, rounds)
        cells = []
        for mode in MODES:
            ours = {name: t for name, t in ms.items() if name.startswith(mode)}
            faster = min(ours, key=ours.get)
            programs = "query-head" if hopper_inputs.query_head_programs(h, kv, n, mode == "fused") else "kv-head"
            pick = f"{mode}, {programs}"
            behind = "the faster" if pick == faster else f"{ours[pick] / ours[faster] - 1:.1%} behind"
            cells.append(f"{mode}: {ms['cudnn'] / ours[faster]:.3f}, {programs} {behind}")
        print(f"B{b} H{h} KV{kv} N{n} D{d} [default {picks[b, h, kv, n, d, causal]}]: "
              + " | ".join(f"{name} {t:.4f}" for name, t in ms.items()) + " | ratio " + "; ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="flash's fused and deterministic backward against SDPA's cuDNN, bf16")
    parser.add_argument("--graphed", action="store_true", help="replayed from CUDA graphs, around FUSED_MIN's bounds")
    parser.add_argument("--gqa", action="store_true", help="replayed, GQA: query-head against key/value-head programs")
    args = parser.parse_args()
    run, shapes = (gqa, GQA_SHAPES) if args.gqa else (graphed, GRAPHED_SHAPES) if args.graphed else (eager, SHAPES)
    picks = default_modes(shapes)
    # the Hopper kernels, and either mode, at any size
    hopper_inputs.MIN_SCORES = hopper_inputs.min_scores_at_every_head_dim(0, 0)
    hopper_inputs.FUSED_MIN = hopper_inputs.FUSED_AT_EVERY_SIZE
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    run(picks)


if __name__ == "__main__":
    main()
