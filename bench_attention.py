"""How fast, and how much memory, is each attention backend at each size?

    python bench_attention.py --preset seed                  # batch 8, 1 head, fp32, seq 256..16384, d 16..128
    python bench_attention.py --preset flash                 # batch 1, 16 heads, causal, seq 128..65536, bf16+fp32
    python bench_attention.py --preset leaderboard           # flash vs SDPA kernels vs flex at seq 16384, d 64
    python bench_attention.py --backends naive,flash --seq-lens 1024,4096 --d-heads 64 --dtype bf16 --causal both
    python bench_attention.py --seq-lens 16384 --d-heads 64 --explain-memory
    python bench_attention.py --preset leaderboard --seq-lens 4096,16384 --graph-timing   # + GPU time without launches
    python bench_attention.py --preset variants              # GQA, windows, packed documents, softcap, all together
    python bench_attention.py --preset training              # the shapes models train with, against cuDNN and FA-2
    python bench_attention.py --preset training --deterministic  # flash's bitwise-reproducible backward instead
    python bench_attention.py --preset training --rounds 3   # times: medians of 3 rounds, the backends taking turns
    python bench_attention.py --seq-lens 8192 --heads 32 --kv-heads 8 --window 1024 --doc-len 1024 --softcap 50

For each point (batch, heads, seq, d_head, dtype, causal, and the variants: key/value heads, window, softcap, packed
documents of a mean length drawn at random per point) and backend: forward, backward and forward+backward
times, TFLOP/s, memory kept for backward, forward/backward peak memory, the time ratio to a baseline backend,
and the error of the output and gradients against a float64 reference; for flash, which kernels ran each pass
(Triton or Hopper) and why. Out of memory is a row, not a crash.
--graph-timing adds the forward and forward+backward times of each call replayed from a CUDA graph: the GPU time
alone, which is what a graphed training step pays. Short problems are bound by host time without it, which moves
over seconds: --rounds N times every point N times, the backends taking turns on the same inputs, and keeps each
time's median.
Writes results.md, results.csv, results.json and PNG plots to --out (default a new runs/bench_attention/<time> per
run; a folder that holds an earlier run's results is refused). The presets are sized for a GPU: on a CPU, a sweep
estimated at hours starts with a warning naming a CPU-sized run like it. Ctrl-C or SIGTERM stops a sweep within
seconds, keeping the finished points (exit status 130). How each figure is measured:
benchmarking/attention_measure.py.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from attention import backend_names, list_attention
from benchmarking import report
from benchmarking.attention_estimate import rough, sweep_seconds
from benchmarking.attention_measure import (BWD_DIFFERENCE, TIME_COLUMNS, measure_backend, tflops_columns,
                                            time_again)
from benchmarking.attention_memory import explain_backend, explain_header
from benchmarking.attention_point import DTYPES, AttentionInputs, AttentionPoint, make_inputs
from benchmarking.attention_reference import RELATIVE_TOLERANCE, Reference, reference
from benchmarking.decode import DECODE_COLUMNS, attention_decode_rows
from benchmarking.environment import describe, environment_info
from benchmarking.interruption import STOPPED_STATUS, note_interrupted, stop_reason, stops_promptly, tell
from benchmarking.oom import OOM_STATUS, call_catching_oom, free_memory, short_message
from benchmarking.output import earlier_results, new_out_dir
from benchmarking.timing import to_mib
from training.cli import OneLineParser
from training.progress import Progress

SEED_SEQ_LENS = [256, 1024, 4096, 8192, 16384]
FLASH_SEQ_LENS = [128 * 2**i for i in range(10)]  # 128 .. 65536

# Fields a preset sets; explicit command-line flags override each one. Two keys describe the preset instead:
# "sized_for": "gpu" marks the presets whose shapes take hours or days on a CPU (flash in the Triton interpreter,
# attention over 16384 positions), and "cpu_run" gives the flags of a run like it that a CPU does in minutes; on a
# CPU such a preset starts with a warning naming them (cpu_warning).
PRESETS: dict[str, dict[str, Any]] = {
    # The seed study: batch 8, one head, fp32, no mask, 100 forward and 100 backward passes.
    "seed": {"batch": 8, "heads": 1, "seq_lens": SEED_SEQ_LENS, "d_heads": [16, 32, 64, 128],
             "dtypes": ["fp32"], "causal": "no", "iters": 100,
             "sized_for": "gpu", "cpu_run": "--preset seed --seq-lens 128 --d-heads 16,64 --iters 5 --warmup 1"},
    # The FlashAttention-2 benchmark: batch 1, causal, bf16 and fp32, seq 128..65536.
    "flash": {"batch": 1, "heads": 16, "seq_lens": FLASH_SEQ_LENS, "d_heads": [16, 32, 64, 128],
              "dtypes": ["bf16", "fp32"], "causal": "yes", "iters": 100,
              "sized_for": "gpu", "cpu_run": "--preset flash --seq-lens 128 --d-heads 64 --dtype fp32 --iters 5 "
                                             "--warmup 1"},
    # One point, our kernel against the peers; naive would need 16 GiB of probabilities here, so it is left out
    # and the ratio is to PyTorch's own FlashAttention-2 kernel.
    "leaderboard": {"batch": 1, "heads": 16, "seq_lens": [16384], "d_heads": [64], "dtypes": ["bf16"],
                    "causal": "yes", "iters": 100,
                    "backends": ["flash", "sdpa", "sdpa-flash", "sdpa-cudnn", "flex"], "baseline": "sdpa-flash",
                    "sized_for": "gpu", "cpu_run": "--preset leaderboard --seq-lens 256 --dtype fp32 --iters 5 "
                                                   "--warmup 1"},
    # The attention variants, each alone and all together, beside the plain causal attention of the same shape.
    # sdpa runs windows and documents through a materialised mask; the pinned kernels take GQA only.
    "variants": {"dtypes": ["bf16"], "iters": 100, "backends": ["flash", "sdpa", "sdpa-cudnn", "flex"],
                 "baseline": "flex", "sized_for": "gpu",
                 "cpu_run": "--backends flash,sdpa,flex --baseline flex --heads 4 --kv-heads 2 --seq-lens 256 "
                            "--d-heads 64 --window 64 --doc-len 64 --softcap 50 --iters 5 --warmup 1",
                 "points": [
                     dict(batch=4, heads=32, kv_heads=8, seq=8192, d_head=128, causal=True),
                     dict(batch=1, heads=16, seq=16384, d_head=64, causal=True),
                     dict(batch=1, heads=16, seq=16384, d_head=64, causal=True, window=1024),
                     dict(batch=1, heads=16, seq=16384, d_head=64, causal=True, doc_len=1024),
                     dict(batch=1, heads=16, seq=16384, d_head=64, causal=True, softcap=50.0),
                     dict(batch=1, heads=16, kv_heads=4, seq=16384, d_head=64, causal=True, window=1024,
                          doc_len=1024, softcap=50.0)]},
    # The attention of the shapes models train with: long sequences, the small and large presets' layers, the host
    # cost alone (B1 H1 N128), head dim 128, Llama-style GQA, and one without a mask; against SDPA's cuDNN and
    # FlashAttention-2.
    "training": {"dtypes": ["bf16"], "iters": 100, "backends": ["flash", "sdpa-cudnn", "sdpa-flash", "flex"],
                 "baseline": "sdpa-cudnn", "sized_for": "gpu",
                 "cpu_run": "--backends flash,sdpa,flex --baseline sdpa --heads 4 --seq-lens 128,256 --d-heads 64 "
                            "--iters 5 --warmup 1",
                 "points": [
                     dict(batch=1, heads=16, seq=16384, d_head=64, causal=True),
                     dict(batch=1, heads=16, seq=4096, d_head=64, causal=True),
                     dict(batch=16, heads=12, seq=1024, d_head=64, causal=True),
                     dict(batch=4, heads=20, seq=1024, d_head=64, causal=True),
                     dict(batch=1, heads=1, seq=128, d_head=64, causal=True),
                     dict(batch=8, heads=16, seq=2048, d_head=128, causal=True),
                     dict(batch=2, heads=16, seq=8192, d_head=128, causal=True),
                     dict(batch=1, heads=32, seq=32768, d_head=128, causal=True),
                     dict(batch=2, heads=16, seq=2048, d_head=64, causal=True),
                     dict(batch=8, heads=32, seq=512, d_head=128, causal=True),
                     dict(batch=8, heads=16, kv_heads=4, seq=4096, d_head=128, causal=True),
                     dict(batch=1, heads=64, kv_heads=8, seq=8192, d_head=128, causal=True),
                     dict(batch=2, heads=16, seq=8192, d_head=64, causal=False)]},
}
PRESET_NOTES = ("sized_for", "cpu_run")  # the keys of PRESETS that are not fields of the sweep
CPU_WARN_S = 600.0  # a sweep estimated longer than this on the CPU starts with a warning
# Flags that set the shape of the points: presets that list their points take none of them.
SHAPE_FLAGS = ("batch", "heads", "seq_lens", "d_heads", "causal", "kv_heads", "window", "softcap", "doc_len")

# Without a preset. dtype None means bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are slow, not representative).
DEFAULTS: dict[str, Any] = {"batch": 1, "heads": 8, "seq_lens": [256, 1024, 4096], "d_heads": [64], "dtypes": None,
                            "causal": "yes", "iters": 100, "warmup": 10, "backends": None, "baseline": "naive",
                            "seed": 0, "kv_heads": None, "window": None, "softcap": None, "doc_len": None,
                            "points": None}

# Column order of results.csv / results.json rows.
COLUMNS = [
    "backend", "point", "batch", "heads", "kv_heads", "seq", "d_head", "dtype", "causal", "window", "softcap",
    "doc_len", "status", "note",
    "fwd_kernel", "bwd_kernel", "kernel_reason",
    "fwd_ms", "bwd_ms", "fwdbwd_ms", "bwd_method", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops",
    "fwd_ratio", "bwd_ratio", "fwdbwd_ratio", "fwd_graph_ms", "fwdbwd_graph_ms", "fwdbwd_graph_ratio",
    "inputs_mib", "saved_mib", "saved_tensors_mib", "fwd_peak_mib", "bwd_peak_mib",
    "err_out", "err_dq", "err_dk", "err_dv", "rel_err", "check", "device",
]


# --- arguments ------------------------------------------------------------------------------------------


def _positive_ints(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {part!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"sizes must be positive, got {value}")
        values.append(value)
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _dtypes(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    if not names:
        raise argparse.ArgumentTypeError("expected at least one dtype")
    return names


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def build_parser() -> OneLineParser:
    """The flags; an error is one line and exit status 2 (OneLineParser), never a usage dump."""
    p = OneLineParser(
        prog="bench_attention.py",
        description="Time and memory of each attention backend at each size; see the module docstring.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named sweep; explicit flags override its fields")
    p.add_argument("--backends", type=_names, help="comma-separated registry names (default: all that can run here)")
    p.add_argument("--baseline", help="backend the *_ratio columns divide by (default: naive)")
    p.add_argument("--batch", type=_positive_int, help="batch size (default: 1)")
    p.add_argument("--heads", type=_positive_int, help="attention heads (default: 8)")
    p.add_argument("--seq-lens", type=_positive_ints, help="comma-separated, e.g. 256,1024,4096")
    p.add_argument("--d-heads", type=_positive_ints, help="comma-separated, e.g. 16,32,64,128")
    p.add_argument("--dtype", "--dtypes", dest="dtypes", type=_dtypes,
                   help=f"comma-separated of {','.join(DTYPES)} (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--causal", choices=["yes", "no", "both"], help="causal mask, none, or both (default: yes)")
    p.add_argument("--kv-heads", type=_positive_int, help="key/value heads, a divisor of --heads (GQA; default: "
                                                          "as many as --heads)")
    p.add_argument("--window", type=_positive_int, help="sliding window: each query sees this many keys back "
                                                        "(and ahead, without --causal)")
    p.add_argument("--softcap", type=_positive_float, help="logit soft-cap: scores s become c*tanh(s/c)")
    p.add_argument("--doc-len", type=_positive_int, help="pack each sequence with documents of this mean length "
                                                         "(random lengths 1..2L-1, drawn per point)")
    p.add_argument("--iters", type=_positive_int, help="timed calls per pass (default: 100)")
    p.add_argument("--warmup", type=_non_negative_int, help="untimed calls before timing (default: 10)")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="timing rounds per point, the backends taking turns on the same inputs; each time is the "
                        "median of its rounds (default: 1)")
    p.add_argument("--seed", type=_non_negative_int, help="random seed of the inputs (default: 0)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--out", type=Path, help="output folder, new or empty: one that holds an earlier run's results "
                                            "is refused (default: a new runs/bench_attention/<time> per run)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--wandb", choices=["offline", "online"], help="also log the table and plots to W&B")
    p.add_argument("--wandb-project", default="bench_attention")
    p.add_argument("--explain-memory", action="store_true",
                   help="for one point (the largest seq and d_head given, first dtype and mask), print the expected "
                        "bytes of every tensor kept for backward next to the measured figures, and stop")
    p.add_argument("--graph-timing", action="store_true",
                   help="also time forward and forward+backward replayed from a CUDA graph (GPU time without the "
                        "host time of launching; CUDA only)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True, warn_only=True): flash's backward runs its "
                        "bitwise-reproducible kernels instead of the fused one (other backends warn where they "
                        "have none)")
    p.add_argument("--list-backends", action="store_true", help="print the registered backends and exit")
    p.add_argument("--decode", type=_positive_ints, metavar="BATCHES",
                   help="decode points instead, at these batch sizes (e.g. 1,8,64): one query per sequence and head "
                        "against a KV cache of each --seq-lens length (default 1024..131072), through each backend's "
                        "decode path (default flash,sdpa,flex); time, GB/s of K and V read, and that over the "
                        "measured copy bandwidth. --kv-heads gives the cache fewer heads (GQA), --window reads only "
                        "its last positions, --graph-timing adds the time replayed from a CUDA graph")
    return p


@dataclass
class Config:
    backends: list[str]
    baseline: str
    batch: int
    heads: int
    seq_lens: list[int]
    d_heads: list[int]
    dtypes: list[str]
    causal: list[bool]
    iters: int
    warmup: int
    seed: int
    device: str
    out: Path
    plots: bool
    wandb: Optional[str]
    wandb_project: str
    preset: Optional[str]
    graph_timing: bool = False
    rounds: int = 1
    command: str = ""
    kv_heads: Optional[int] = None
    window: Optional[int] = None
    softcap: Optional[float] = None
    doc_len: Optional[int] = None
    listed_points: Optional[list[dict[str, Any]]] = None  # a preset's own points (shapes), run in each dtype

    def points(self) -> list[AttentionPoint]:
        if self.listed_points is not None:
            return [AttentionPoint(dtype=dt, **shape) for dt in self.dtypes for shape in self.listed_points]
        return [AttentionPoint(self.batch, self.heads, n, d, dt, c, self.kv_heads, self.window, self.softcap,
                               self.doc_len)
                for dt in self.dtypes for c in self.causal for d in self.d_heads for n in self.seq_lens]

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def resolve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    """Merge explicit flags over the preset over DEFAULTS, and check names against the registry."""
    merged = dict(DEFAULTS)
    merged.update({k: v for k, v in PRESETS.get(args.preset, {}).items() if k not in PRESET_NOTES})
    if merged["points"] is not None:
        given = [key for key in SHAPE_FLAGS if getattr(args, key) is not None]
        if given:
            parser.error(f"--{given[0].replace('_', '-')}: --preset {args.preset} lists its own points; "
                         "use the flags without a preset")
    for key in ("backends", "baseline", "batch", "heads", "seq_lens", "d_heads", "dtypes", "causal", "iters",
                "warmup", "seed", "kv_heads", "window", "softcap", "doc_len"):
        if getattr(args, key) is not None:
            merged[key] = getattr(args, key)
    if merged["kv_heads"] is not None and merged["heads"] % merged["kv_heads"]:
        parser.error(f"--kv-heads {merged['kv_heads']}: must divide --heads {merged['heads']}")

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available here (use --device cpu)")
    if args.graph_timing and device != "cuda":
        parser.error(f"--graph-timing replays CUDA graphs: it needs --device cuda, got {device}")
    registered = backend_names()
    if merged["backends"] is None:
        merged["backends"] = [b.name for b in list_attention() if b.available]
    if not merged["backends"]:
        parser.error("--backends: no backend given")
    for name in [*merged["backends"], merged["baseline"]]:
        if name not in registered:
            parser.error(f"unknown attention backend {name!r}; valid: {', '.join(registered)}")
    if not args.decode and (problem := _nothing_runs_here(merged["backends"], args.preset)):
        parser.error(problem)
    if merged["dtypes"] is None:
        merged["dtypes"] = ["bf16"] if device == "cuda" else ["fp32"]
    causal = {"yes": [True], "no": [False], "both": [False, True]}[merged["causal"]]
    out = args.out or new_out_dir(Path("runs/bench_attention"))
    return Config(
        backends=list(dict.fromkeys(merged["backends"])), baseline=merged["baseline"], batch=merged["batch"],
        heads=merged["heads"], seq_lens=list(merged["seq_lens"]), d_heads=list(merged["d_heads"]),
        dtypes=list(merged["dtypes"]), causal=causal, iters=merged["iters"], warmup=merged["warmup"],
        seed=merged["seed"], device=device, out=out, plots=not args.no_plots, wandb=args.wandb,
        wandb_project=args.wandb_project, preset=args.preset, graph_timing=args.graph_timing, rounds=args.rounds,
        kv_heads=merged["kv_heads"], window=merged["window"], softcap=merged["softcap"], doc_len=merged["doc_len"],
        listed_points=merged["points"],
    )


def _nothing_runs_here(backends: Sequence[str], preset: Optional[str]) -> Optional[str]:
    """Why a sweep none of whose backends can run on this machine is refused (it would write only unsupported rows)."""
    unavailable = {b.name: b.reason for b in list_attention() if not b.available}
    if not backends or any(name not in unavailable for name in backends):
        return None
    which = f"--preset {preset}'s backends" if preset else "--backends"
    return f"none of {which} can run here: " + "; ".join(f"{name}: {unavailable[name]}" for name in backends)


def cpu_warning(cfg: Config, explain: bool = False) -> Optional[str]:
    """On the CPU, the one line that says a sweep will take long (an estimate) and how to make it CPU-sized, or None;
    `explain`: of --explain-memory's one untimed point instead.

    A preset marked sized_for gpu names what it is meant for and its cpu_run flags."""
    if cfg.device != "cpu":
        return None
    available = {b.name for b in list_attention() if b.available}
    points = [explained_point(cfg)] if explain else cfg.points()
    seconds = sweep_seconds(points, [b for b in cfg.backends if b in available], cfg.warmup, cfg.iters,
                            timed=not explain, rounds=cfg.rounds)
    if seconds < CPU_WARN_S:
        return None
    about = f"roughly {rough(seconds)} on this CPU" + (
        " (flash runs in the Triton interpreter)" if "flash" in cfg.backends and "flash" in available else "")
    preset = PRESETS.get(cfg.preset or "", {})
    if preset.get("sized_for") == "gpu":
        return (f"warning: --preset {cfg.preset} is sized for a GPU: {about}; a CPU-sized run like it: "
                f"python bench_attention.py {preset['cpu_run']}")
    return (f"warning: this sweep takes {about}; fewer and shorter --seq-lens, fewer --heads and --batch, and "
            "--iters 5 --warmup 1 make it CPU-sized")


# --- the sweep -------------------------------------------------------------------------------------------


def _allow_many_compilations() -> None:
    # A sweep compiles flex/compiled once per shape; past dynamo's default limit of 8 recompilations it would
    # silently fall back to eager and the figures would be of the wrong thing.
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 1024))
            break


def _row(point: AttentionPoint, backend: str, device: str, inputs_mib: Optional[float]) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(backend=backend, point=point.label(), **point.as_row(), device=device, inputs_mib=inputs_mib)
    return row


def _add_ratios(rows: list[dict[str, Any]], baseline: str) -> None:
    """time / baseline's time at the same point, for each pass; blank when the baseline has no time."""
    base = next((r for r in rows if r["backend"] == baseline), None)
    for row in rows:
        for pass_name in ("fwd", "bwd", "fwdbwd", "fwdbwd_graph"):
            mine = row.get(f"{pass_name}_ms")
            theirs = base.get(f"{pass_name}_ms") if base else None
            row[f"{pass_name}_ratio"] = mine / theirs if mine is not None and theirs else None


def run_point(point: AttentionPoint, cfg: Config, progress: Optional[Progress] = None, time_passes: bool = True
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for every backend at `point` (same inputs for all), and the measured saved tensors per backend."""
    saved_by_backend: dict[str, Any] = {}
    made = call_catching_oom(lambda: make_inputs(point, cfg.device, seed=cfg.seed), label=f"inputs {point.label()}")
    if made.oom:  # not even q, k, v fit: every backend is OOM here
        rows = [_row(point, b, cfg.device, None) | {"status": OOM_STATUS, "note": f"inputs: {made.message}"}
                for b in cfg.backends]
        if progress is not None:
            progress.update(len(cfg.backends))
        return rows, saved_by_backend
    inputs: AttentionInputs = made.value
    inputs_mib = to_mib(sum(t.numel() * t.element_size() for t in inputs.leaves()))
    ref_outcome = call_catching_oom(lambda: reference(inputs, point.causal, window=point.window,
                                                      softcap=point.softcap), label=f"reference {point.label()}")
    ref: Optional[Reference] = ref_outcome.value

    rows = []
    for backend in cfg.backends:
        label = f"{backend} {point.label()}"
        if progress is not None:
            progress.report(label)
        row = _row(point, backend, cfg.device, inputs_mib)
        try:
            outcome = call_catching_oom(
                lambda: measure_backend(backend, point, inputs, ref, cfg.device, iters=cfg.iters,
                                        warmup=cfg.warmup, time_passes=time_passes,
                                        graph_timing=cfg.graph_timing),
                label=label)
        except Exception as exc:  # noqa: BLE001 -- a broken backend is a result row; the sweep goes on
            row.update(status="error", note=f"{type(exc).__name__}: {short_message(exc)}")
            (progress.write if progress is not None else _stderr)(f"error: {label}: {row['note']}")
        else:
            if outcome.oom:
                row.update(status=OOM_STATUS, note=outcome.message)
            else:
                row.update(outcome.value.row)
                saved_by_backend[backend] = outcome.value.saved
        if ref is None and row["status"] == "ok":
            row["note"] = "; ".join(filter(None, [row["note"], f"no float64 reference: {ref_outcome.message}"]))
        for t in inputs.leaves():
            t.grad = None
        free_memory()
        rows.append(row)
        if progress is not None:
            progress.update(1)
    if time_passes and cfg.rounds > 1:
        _more_rounds(rows, point, inputs, cfg)
    _add_ratios(rows, cfg.baseline)
    del inputs, ref
    free_memory()
    return rows, saved_by_backend


def _more_rounds(rows: list[dict[str, Any]], point: AttentionPoint, inputs: AttentionInputs, cfg: Config) -> None:
    """Rounds 2..cfg.rounds of the timings, the measured backends taking turns; each time becomes the median of its
    rounds. A backend that fails in a later round keeps the rounds it finished, and says so in its note."""
    timed = [row for row in rows if row["status"] == "ok"]
    samples = [{key: [row[key]] for key in TIME_COLUMNS if row[key] is not None} for row in timed]
    failed: set[int] = set()
    for _ in range(cfg.rounds - 1):
        for i, row in enumerate(timed):
            if i in failed:
                continue
            try:
                again = call_catching_oom(lambda: time_again(row["backend"], point, inputs, cfg.device,
                                                             iters=cfg.iters, warmup=cfg.warmup,
                                                             graph_timing=cfg.graph_timing))
                problem = again.message if again.oom else None
            except Exception as exc:  # noqa: BLE001 -- the rounds it finished still stand
                problem = f"{type(exc).__name__}: {short_message(exc)}"
            for t in inputs.leaves():
                t.grad = None
            if problem is not None:
                failed.add(i)
                done = len(samples[i].get("fwd_ms", [None]))
                row["note"] = "; ".join(filter(None, [row["note"], f"timed in {done} rounds: {problem}"]))
                continue
            for key, values in samples[i].items():
                if again.value[key] is not None:
                    values.append(again.value[key])
    for row, columns in zip(timed, samples):
        row.update({key: statistics.median(values) for key, values in columns.items()})
        row.update(tflops_columns(row, point, inputs))
    free_memory()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Sweep:
    """The rows of the finished points, and the point being measured (left out if the sweep stops during it)."""

    cfg: Config
    environment: Optional[dict[str, Any]]
    total: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    current: Optional[AttentionPoint] = None

    def stopped(self, reason: str) -> str:
        """The note of a sweep stopped by `reason`, printed and written to results.md."""
        dropped = f"the point {self.current.label()}" if self.current is not None else ""
        return note_interrupted(len(self.rows), self.total, reason, dropped)

    def write_so_far(self, reason: str) -> None:
        """The watchdog's: the main thread is held inside a call of the current point; write the finished ones."""
        rows = list(self.rows)
        write_outputs(rows, self.cfg, self.environment or {}, stopped=self.stopped(reason), plots=False)
        tell(f"wrote {len(rows)} rows to {self.cfg.out}/ (results.md, results.csv, results.json)")


def run_sweep(cfg: Config, environment: Optional[dict[str, Any]] = None) -> tuple[list[dict[str, Any]], Optional[str]]:
    """(rows, None), or (rows so far, why the sweep stopped) when Ctrl-C or SIGTERM ended it early. The point being
    measured then is left out: its backends' rows would lack the ratios to the baseline. results.csv and results.json
    are rewritten after every point, so even a hard kill leaves the finished points."""
    points = cfg.points()
    sweep = Sweep(cfg, environment, len(points) * len(cfg.backends))
    progress = Progress(sweep.total, "bench_attention", unit="run", every_s=30.0)
    try:
        with stops_promptly(sweep.write_so_far):
            for point in points:
                sweep.current = point
                point_rows, _ = run_point(point, cfg, progress)
                sweep.rows.extend(point_rows)
                sweep.current = None
                report.write_csv(sweep.rows, cfg.out / "results.csv", COLUMNS)
                report.write_json(sweep.rows, cfg.out / "results.json", environment, cfg.as_dict())
    except KeyboardInterrupt as interrupt:
        progress.close()
        return sweep.rows, sweep.stopped(stop_reason(interrupt))
    finally:
        progress.close()
    return sweep.rows, None


# --- output ----------------------------------------------------------------------------------------------


def _group_name(dtype: str, causal: bool) -> str:
    return f"{dtype}_{'causal' if causal else 'full'}"


def _groups(rows: Sequence[dict[str, Any]]) -> list[tuple[str, bool, list[dict[str, Any]]]]:
    keys = list(dict.fromkeys((r["dtype"], r["causal"]) for r in rows))
    return [(dt, c, [r for r in rows if (r["dtype"], r["causal"]) == (dt, c)]) for dt, c in keys]


def _memory_key(cfg: Config) -> tuple[str, str]:
    if cfg.device == "cuda":
        return "saved_mib", "memory kept after forward (MiB, CUDA allocated after forward - before)"
    return "saved_tensors_mib", "memory saved for backward (MiB, tensors autograd saved, excluding q, k, v)"


def _point_blocks(rows: Sequence[dict[str, Any]], cfg: Config) -> list[str]:
    """Tables of a preset that lists its points: one line per point, one column per backend."""
    blocks = []
    passes = [("fwdbwd_ms", "Forward + backward time (ms)"), ("fwd_ms", "Forward time (ms)"),
              ("bwd_ms", "Backward time (ms)")]
    if cfg.graph_timing:
        passes.append(("fwdbwd_graph_ms", "Forward + backward time (ms) replayed from a CUDA graph"))
    passes += [("fwdbwd_ratio", f"Forward + backward time / `{cfg.baseline}`'s"),
               ("fwdbwd_tflops", "Forward + backward TFLOP/s")]
    for key, title in passes:
        blocks.append(f"## {title}")
        blocks.append(report.pivot_markdown(rows, "point", "backend", key, column_label="backend"))
    return blocks


def markdown_blocks(rows: Sequence[dict[str, Any]], cfg: Config, stopped: Optional[str] = None) -> list[str]:
    """The blocks of results.md; `stopped` is the note of a sweep that Ctrl-C or SIGTERM ended early."""
    memory_key, memory_title = _memory_key(cfg)
    shape = "points as listed" if cfg.listed_points is not None else f"batch {cfg.batch}, heads {cfg.heads}"
    blocks = [
        f"Command: `{cfg.command}`",
        f"Device {cfg.device}; {shape}; median of ~{cfg.iters} calls after {cfg.warmup} warm-up calls per pass"
        f"{_rounds_words(cfg.rounds)}; ratios are time / time of `{cfg.baseline}` at the same point "
        "(below 1 = faster). TFLOP/s count 4·B·H·N²·D per forward (half when causal; with a window or documents, "
        "4·B·H·D per score computed), 2.5x that for backward. "
        "Errors: max |backend - float64 reference| over sampled query rows, with `check` = FAIL when the "
        f"relative error exceeds {', '.join(f'{k} {v:g}' for k, v in RELATIVE_TOLERANCE.items())}. "
        "OOM = ran out of memory; unsupported = the backend cannot run this input (reason in results.csv).",
    ]
    if stopped:
        blocks.append(f"**Incomplete**: {stopped.removesuffix('; writing the results so far')}.")
    if cfg.listed_points is not None:
        blocks += _point_blocks(rows, cfg)
    else:
        blocks += _sweep_blocks(rows, cfg, memory_key, memory_title)
    blocks += _summary_blocks(rows)
    return blocks


def _rounds_words(rounds: int) -> str:
    return "" if rounds == 1 else f", then the median of {rounds} such rounds, the backends taking turns"


def _sweep_blocks(rows: Sequence[dict[str, Any]], cfg: Config, memory_key: str, memory_title: str) -> list[str]:
    """Tables of a sweep over sequence lengths and head dims."""
    blocks = ["## Forward + backward time (ms) by backend"]
    for dtype, causal, group in _groups(rows):
        for d in report.unique_in_order(group, "d_head"):
            subset = [r for r in group if r["d_head"] == d]
            blocks.append(f"### {dtype}, {'causal' if causal else 'no mask'}, d_head {d}")
            blocks.append(report.pivot_markdown(subset, "seq", "backend", "fwdbwd_ms", column_label="backend"))
    if cfg.graph_timing:
        blocks.append("## Forward + backward time (ms) replayed from a CUDA graph: GPU time, no launch cost")
        for dtype, causal, group in _groups(rows):
            for d in report.unique_in_order(group, "d_head"):
                subset = [r for r in group if r["d_head"] == d]
                blocks.append(f"### {dtype}, {'causal' if causal else 'no mask'}, d_head {d}")
                blocks.append(report.pivot_markdown(subset, "seq", "backend", "fwdbwd_graph_ms",
                                                    column_label="backend"))
    blocks.append("## Per backend: seq x d_head")
    for dtype, causal, group in _groups(rows):
        for backend in report.unique_in_order(group, "backend"):
            subset = [r for r in group if r["backend"] == backend]
            blocks.append(f"### {backend}, {dtype}, {'causal' if causal else 'no mask'}")
            for key, title in (("fwd_ms", "forward (ms)"), ("bwd_ms", "backward (ms)"), (memory_key, memory_title),
                               ("fwdbwd_tflops", "forward + backward TFLOP/s")):
                blocks.append(f"{title}\n\n" + report.pivot_markdown(subset, "seq", "d_head", key))
    return blocks


def _summary_blocks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Correctness, the kernels flash ran, and what did not run, for any set of points."""
    blocks = ["## Correctness (worst over the points each backend ran)"]
    blocks.append(report.markdown_table(_correctness_summary(rows),
                                        ["backend", "dtype", "points", "max_rel_err", "max_err_out", "max_err_dq",
                                         "max_err_dk", "max_err_dv", "failed"]))
    kernels = [r for r in rows if r.get("fwd_kernel")]
    if kernels:
        blocks.append("## Kernels flash ran (Triton or Hopper), and why")
        blocks.append(report.markdown_table(kernels, ["point", "fwd_kernel", "bwd_kernel", "kernel_reason"]))
    not_run = _not_run_summary(rows)
    if not_run:
        blocks.append("## Not run, or forward only")
        blocks.append(report.markdown_table(not_run, ["backend", "status", "points", "reason"]))
    if any(r.get("bwd_method") == BWD_DIFFERENCE for r in rows):
        blocks.append(f"Backward times marked `{BWD_DIFFERENCE}` in results.csv are (forward+backward) - forward: "
                      "the backend's backward cannot be replayed with retain_graph.")
    return blocks


def _worst(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _correctness_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = []
    for backend, dtype in dict.fromkeys((r["backend"], r["dtype"]) for r in rows):
        ran = [r for r in rows if r["backend"] == backend and r["dtype"] == dtype and r.get("rel_err") is not None]
        if not ran:
            continue
        summary.append({"backend": backend, "dtype": dtype, "points": len(ran),
                        "max_rel_err": _worst([r["rel_err"] for r in ran]),
                        **{f"max_err_{k}": _worst([r[f"err_{k}"] for r in ran]) for k in ("out", "dq", "dk", "dv")},
                        "failed": sum(r["check"] == "FAIL" for r in ran)})
    return summary


def _not_run_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    counts: dict[tuple[str, str, str], int] = {}
    for r in rows:
        note = r.get("note") or ""
        if r["status"] != "ok" or note.startswith("forward only"):
            status = r["status"] if r["status"] != "ok" else "forward only"
            key = (r["backend"], status, note.removeprefix("forward only: "))
            counts[key] = counts.get(key, 0) + 1
    return [{"backend": b, "status": s, "points": n, "reason": reason} for (b, s, reason), n in counts.items()]


def write_plots(rows: Sequence[dict[str, Any]], cfg: Config) -> dict[str, Path]:
    """PNG per (dtype, mask) group: times, memory and TFLOP/s against seq, one line per backend, one panel per d."""
    memory_key, _ = _memory_key(cfg)
    plots: dict[str, Path] = {}
    for dtype, causal, group in _groups(rows):
        name = _group_name(dtype, causal)
        specs = [
            (f"time_fwd_{name}", "fwd_ms", "forward time (ms)", True),
            (f"time_bwd_{name}", "bwd_ms", "backward time (ms)", True),
            (f"time_fwdbwd_{name}", "fwdbwd_ms", "forward + backward time (ms)", True),
            (f"memory_{name}", memory_key, "memory kept for backward (MiB)", True),
            (f"tflops_{name}", "fwdbwd_tflops", "forward + backward TFLOP/s", False),
        ]
        for stem, key, label, logy in specs:
            path = report.plot_lines(group, "seq", key, "backend", cfg.out / f"{stem}.png", facet="d_head",
                                     title=f"{label}, {dtype}, {'causal' if causal else 'no mask'}",
                                     xlabel="sequence length", ylabel=label, logx=True, logy=logy)
            if path is not None:
                plots[stem] = path
    return plots


def write_outputs(rows: list[dict[str, Any]], cfg: Config, environment: dict[str, Any],
                  stopped: Optional[str] = None, plots: bool = True) -> dict[str, Path]:
    """results.md/.csv/.json, the plots (unless `plots` is False) and W&B as asked; `stopped`: see markdown_blocks."""
    files = {
        "md": report.write_markdown(cfg.out / "results.md", "Attention benchmark",
                                    markdown_blocks(rows, cfg, stopped), environment),
        "csv": report.write_csv(rows, cfg.out / "results.csv", COLUMNS),
        "json": report.write_json(rows, cfg.out / "results.json", environment, cfg.as_dict()),
    }
    # Plots draw lines over sequence lengths; a preset's listed points are not such a series.
    images = write_plots(rows, cfg) if plots and cfg.plots and cfg.listed_points is None else {}
    files.update(images)
    if cfg.wandb and plots:
        report.log_wandb(rows, mode=cfg.wandb, project=cfg.wandb_project, run_name=cfg.out.name, images=images,
                         config=cfg.as_dict(), environment=environment, directory=cfg.out)
    return files


# --- explain-memory -------------------------------------------------------------------------------------


def explained_point(cfg: Config) -> AttentionPoint:
    """The one point --explain-memory measures: the largest seq and d_head, the first dtype and mask; a preset's
    first listed point."""
    return cfg.points()[0] if cfg.listed_points is not None else AttentionPoint(
        cfg.batch, cfg.heads, max(cfg.seq_lens), max(cfg.d_heads), cfg.dtypes[0], cfg.causal[0], cfg.kv_heads,
        cfg.window, cfg.softcap, cfg.doc_len)


def explain_memory(cfg: Config) -> tuple[list[dict[str, Any]], str]:
    """Measure one point (explained_point) and explain each backend's memory."""
    point = explained_point(cfg)
    rows, saved = run_point(point, cfg, time_passes=False)
    blocks = [explain_header(point, cfg.device)]
    blocks += [explain_backend(r["backend"], point, r, saved.get(r["backend"])) for r in rows]
    return rows, "\n\n".join(blocks)


# --- entry point ---------------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    rows: list[dict[str, Any]]
    config: Config
    environment: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)
    explanation: Optional[str] = None
    complete: bool = True  # False when Ctrl-C or SIGTERM stopped the sweep early


def _backend_listing() -> str:
    return "\n".join(f"{b.name:<12} {'yes' if b.available else 'no ':<4} {b.description}"
                     + ("" if b.available else f" ({b.reason})") for b in list_attention())


def decode_points(args: argparse.Namespace, cfg: Config, environment: dict[str, Any]) -> BenchResult:
    """--decode: the rows of benchmarking.decode.attention_decode_rows, written as decode.md/.csv/.json."""
    cache_lens = args.seq_lens or [1024 * 2 ** i for i in range(8)]
    backends = args.backends or ["flash", "sdpa", "flex"]
    rows = []
    for dtype in cfg.dtypes:
        rows += attention_decode_rows(backends, args.decode, cfg.heads, cache_lens, cfg.d_heads, DTYPES[dtype],
                                      torch.device(cfg.device), cfg.kv_heads, cfg.window, cfg.graph_timing)
    cfg.out.mkdir(parents=True, exist_ok=True)
    table = report.markdown_table(rows, DECODE_COLUMNS, {"ms": ".4f", "gbs": ".0f", "copy_fraction": ".0%",
                                                          "graph_ms": ".4f", "graph_copy_fraction": ".0%"})
    report.write_markdown(cfg.out / "decode.md", "Decode attention", [f"`{cfg.command}`", table],
                          environment=environment)
    files = {"decode.csv": report.write_csv(rows, cfg.out / "decode.csv", DECODE_COLUMNS),
             "decode.json": report.write_json(rows, cfg.out / "decode.json", environment)}
    print(table)
    print(f"wrote {len(rows)} rows to {cfg.out}/ (decode.md, decode.csv, decode.json)", file=sys.stderr)
    return BenchResult(rows, cfg, environment, files)


def main(argv: Optional[Sequence[str]] = None) -> Optional[BenchResult]:
    """Run the benchmark for command-line `argv`; returns its rows, config, environment and written files."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_backends:
        print(_backend_listing())
        return None
    cfg = resolve_config(args, parser)
    if args.decode and (args.softcap is not None or args.doc_len is not None):
        parser.error("--decode times GQA (--kv-heads) and windows (--window); --softcap and --doc-len do not "
                     "apply to it")
    if args.rounds > 1 and (args.decode or args.explain_memory):
        parser.error(f"--rounds {args.rounds}: {'--decode' if args.decode else '--explain-memory'} times each "
                     "point once")
    if not args.explain_memory and (problem := earlier_results(cfg.out)):  # --explain-memory writes no files
        parser.error(problem)
    cfg.command = shlex.join(["python", "bench_attention.py", *(sys.argv[1:] if argv is None else argv)])
    _allow_many_compilations()
    environment = environment_info(cfg.device)
    print(f"bench_attention on {describe(environment)}", file=sys.stderr)
    if not args.decode and (warning := cpu_warning(cfg, explain=args.explain_memory)):
        print(warning, file=sys.stderr, flush=True)

    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        if args.decode:
            return decode_points(args, cfg, environment)
        if args.explain_memory:
            rows, text = explain_memory(cfg)
            print(text)
            return BenchResult(rows, cfg, environment, explanation=text)
        return sweep_and_write(cfg, environment)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def sweep_and_write(cfg: Config, environment: dict[str, Any]) -> BenchResult:
    """The sweep, then its files; the rows so far when Ctrl-C or SIGTERM stopped it (complete False)."""
    rows, stopped = run_sweep(cfg, environment)
    files = write_outputs(rows, cfg, environment, stopped)
    tell(f"wrote {len(rows)} rows{'' if stopped is None else ' (sweep stopped early)'} to {cfg.out}/ (results.md, "
         f"results.csv, results.json{', plots' if cfg.plots and cfg.listed_points is None else ''})")
    for r in rows:
        if r["status"] == "error" or r["check"] == "FAIL":
            print(f"  {r['backend']} at seq={r['seq']} d={r['d_head']} {r['dtype']}: "
                  f"{r['status'] if r['status'] == 'error' else 'FAIL, rel_err ' + format(r['rel_err'], '.3g')}"
                  f" {r['note'] or ''}", file=sys.stderr)
    return BenchResult(rows, cfg, environment, files, complete=stopped is None)


def cli() -> int:
    """Exit status 1 when a backend raised or failed the correctness check, so scripts notice; 130 when Ctrl-C or
    SIGTERM stopped the sweep (its files hold the finished points)."""
    result = main()
    if result is None:
        return 0
    if not result.complete:
        return STOPPED_STATUS
    return int(any(r["status"] == "error" or r.get("check") == "FAIL" for r in result.rows))


if __name__ == "__main__":
    sys.exit(cli())
