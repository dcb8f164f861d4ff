"""Benchmark the whole Transformer LM: forward, backward and AdamW step times, tokens/s, MFU and peak memory.

Sweeps sizes x context lengths x attention backends x dtypes x compile x modes on random tokens; an OOM is a
result, not a crash. The train-step is the one train.py runs (training/step.py: the same compile, DDP/FSDP wrap,
AdamW and CUDA graph), timed without gradient clipping. Writes results.md / results.csv / results.json / PNG plots
to --out; --nvtx, --profile and --memory-snapshot make the same runs easy to profile, --explain-memory prints where
the bytes go, --explain-precision the dtype of every tensor of a step under --dtype.

    python bench_model.py --sizes small,medium --context-lengths 128,256,512,1024 --dtype fp32,bf16 \\
        --mode forward-backward

On several GPUs (weak scaling: --batch-size sequences per GPU), with scaling efficiency against one GPU:

    torchrun --standalone --nproc-per-node 2 bench_model.py --parallel ddp --sizes large --dtype bf16 --mode train-step
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch
from tqdm import tqdm

from attention import UnsupportedInputError, list_attention
from benchmarking import precision_report, quality_state, report
from benchmarking.decode import sampling_figures
from benchmarking.environment import describe, environment_info
from benchmarking.hf_llama import HFLlama
from benchmarking.interruption import STOPPED_STATUS, note_interrupted, stop_reason, stops_promptly, tell
from benchmarking.model_memory import explain_memory, format_breakdown, measure_saved_bytes, param_count
from benchmarking.model_report import COLUMNS, PARALLEL_COLUMNS, columns_for, run_config, summary_line, write_outputs
from benchmarking.oom import OOM_STATUS, call_catching_oom, free_memory
from benchmarking.output import earlier_results, new_out_dir
from benchmarking.quality import QualitySettings
from benchmarking.timing import peak_allocated_bytes, reset_peak_memory, summarize, synchronize
from model import PRESETS, ModelConfig, TransformerLM, config_for
from profiling import nvtx
from profiling.memory_snapshot import (VIEWER_URL, format_peak, load_snapshot, peak_report, record_memory_history,
                                      snapshot_unavailable)
from profiling.torch_profile import kernel_markdown, profile_steps
from training import fp8
from training.cli import OneLineParser, add_field
from training.config import Config, ConfigError, overlaps_backward, parse_device, resolve
from training.metrics import mfu
from training.optim import optimizer_names
from training.parallel import distributed
from training.parallel.distributed import DistContext, DistributedError
from training.progress import Progress
from training.recipes import RECIPES
from training.step import GRAPH_WARMUP, TrainingStep, build_step

PRECISIONS = ("fp32", "bf16")  # bf16 = autocast over fp32 master weights
IMPLS = ("ours", "hf")
MODES = ("forward", "forward-backward", "train-step", "prefill", "decode")
QUALITY_MODE = "time-to-quality"  # benchmarking/quality.py: recipes trained for a wall-clock budget, alone
# The sweep's defaults of flags whose time-to-quality default is train.py's (left unset there).
SWEEP_DEFAULTS = {"context_lengths": ["128,256,512,1024"], "batch_size": 4, "dtype": ["fp32"], "compile": "off",
                  "cuda_graph": "off", "grad_clip": 0.0}
SAMPLING_MODES = ("prefill", "decode")  # benchmarking/decode.py: bf16/fp32 weights, no autocast, no grad
GIB = 1024**3
BENCH_DIST_TIMEOUT_S = 1800  # the other ranks wait out rank 0's one-GPU baseline at a barrier

# --- arguments -------------------------------------------------------------------------------------------


def _split(values: Optional[Sequence[str]]) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']: lists may be comma-separated, space-separated or both."""
    return [v.strip() for item in values or () for v in item.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("what to run (lists are comma-separated; each combination is one row)")
    m.add_argument("--sizes", nargs="+", help=f"size presets: {', '.join(PRESETS)} (default small)")
    for name in ("d_model", "n_layers", "n_heads", "d_ff", "n_kv_heads"):
        add_field(m, "model", name, shown=True, dest=name,
                  help="custom size (with all of --d-model --n-layers --n-heads --d-ff, named 'custom')"
                  if name != "n_kv_heads" else "key/value heads of every size (GQA)")
    m.add_argument("--vocab-size", type=int, default=10_000, help="vocabulary (default 10000)")
    m.add_argument("--context-lengths", nargs="+", help="context lengths (default 128,256,512,1024)")
    m.add_argument("--batch-size", type=int, help="sequences per step (default 4); with --parallel, per GPU (weak "
                                                  "scaling)")
    m.add_argument("--attn", nargs="+", default=["sdpa"], help="attention backends (default sdpa)")
    m.add_argument("--dtype", nargs="+", help="fp32 (default) and/or bf16 (autocast)")
    m.add_argument("--impl", nargs="+", default=["ours"],
                   help=f"{', '.join(IMPLS)} (default ours). hf is the peer, transformers' Llama (needs "
                        "transformers): same sizes, step, optimizer and tokens, timed in the same run")
    m.add_argument("--compile", nargs="?", const="on", choices=["on", "off", "both"],
                   help="torch.compile the model: on, off (default) or both; a bare --compile means on")
    m.add_argument("--cuda-graph", nargs="?", const="on", choices=["on", "off", "both"],
                   help="replay the whole train-step as one CUDA graph: on, off (default) or both; needs --mode "
                        "train-step, a GPU and --warmup >= 3")
    m.add_argument("--fp8", nargs="+", default=["off"], help="off (default), tensorwise, rowwise (training/fp8.py)")
    m.add_argument("--optimizer", nargs="+", default=["adamw"],
                   help=f"ours, train-step: {', '.join(optimizer_names())} (default adamw)")
    m.add_argument("--grad-clip", type=float,
                   help="train-step: clip the gradient norm (default 0: not clipped, the optimizer then steps during "
                        "the backward where it can; 1.0 is train.py's default step)")
    m.add_argument("--mode", nargs="+", default=["forward-backward"], help=f"{', '.join(MODES)} (default "
                                                                           "forward-backward), or time-to-quality "
                                                                           "alone (below)")
    m.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    m.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    m.add_argument("--seed", type=int, default=0, help="seed for init and the random tokens")
    add_field(m, "execution", "device", shown=True, dest="device")
    d = p.add_argument_group("several GPUs (launch with torchrun)")
    d.add_argument("--parallel", choices=["none", "ddp", "fsdp"], default="none",
                   help="none (default): one device; ddp or fsdp: every torchrun rank runs the wrapped model, after "
                        "a one-GPU baseline on rank 0, and rows report scaling efficiency")
    _add_quality_flags(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", help="directory for results.md/.csv/.json and plots, new or empty: one that holds an "
                                 "earlier run's results is refused (default: a new runs/bench_model/<time> per run)")
    o.add_argument("--wandb", choices=["offline", "online"], help="also log the table and plots to W&B")
    pr = p.add_argument_group("profiling")
    pr.add_argument("--nvtx", action="store_true",
                    help="NVTX ranges (warmup, step, forward, backward, optimizer, naive attention's phases) for nsys")
    pr.add_argument("--profile", metavar="DIR",
                    help="torch.profiler over a few steps: DIR/trace.json (Chrome trace) and DIR/kernels.md")
    pr.add_argument("--profile-steps", type=int, default=3, help="active (recorded) profiler steps (default 3)")
    pr.add_argument("--memory-snapshot", metavar="FILE",
                    help=f"CUDA memory history over a few steps, dumped to FILE (a pickle for {VIEWER_URL})")
    pr.add_argument("--snapshot-steps", type=int, default=3, help="steps recorded in the memory snapshot (default 3)")
    pr.add_argument("--explain-memory", action="store_true",
                    help="print expected bytes (parameters, gradients, optimizer state, activations) beside the "
                         "measured")
    pr.add_argument("--explain-precision", action="store_true",
                    help="print, per --sizes and --dtype, the dtype of every tensor of a training step and why; and "
                         "0.01 summed 1000 times in fp32, fp16 and bf16; times nothing")
    return p


def _add_quality_flags(p: argparse.ArgumentParser) -> None:
    """--mode time-to-quality's own flags."""
    q = p.add_argument_group("time to quality (--mode time-to-quality, alone: benchmarking/quality.py)",
                             "--sizes (or a custom size), one --context-lengths, --batch-size, --attn, --dtype,\n"
                             "--compile, --cuda-graph, --fp8 and --grad-clip, when given, hold for every recipe;\n"
                             "otherwise each recipe's settings and train.py's defaults do (context 1024, batch 16;\n"
                             "on a GPU bf16, compile and CUDA graph where they apply; clipping at 1)")
    q.add_argument("--recipes", nargs="+", default=["adamw,muon"],
                   help=f"recipes to compare, by name ({', '.join(RECIPES)}) or JSON file of config sections "
                        "(default adamw,muon); the first one's final bits per byte is the target")
    q.add_argument("--data", help="what every recipe trains on, as train.py's --data (default: the built-in corpus)")
    q.add_argument("--minutes", nargs="+", default=["20"],
                   help="minutes of training per recipe (default 20): one value for every recipe, or one each in "
                        "--recipes' order (20,10: does the second reach the first's final value in half the time?); "
                        "evaluation and compilation are off the clock, and each recipe's schedule spans its own budget")
    q.add_argument("--eval-interval-s", type=float, default=60.0,
                   help="validation bits per byte every this many seconds of training (default 60)")
    q.add_argument("--eval-batches", type=int, default=10, help="validation batches per evaluation (default 10)")
    q.add_argument("--target-bpb", type=float, help="the target (default: the first recipe's final value)")
    q.add_argument("--stop-at-target", action="store_true",
                   help="end each recipe at its first evaluation at or below the target (the first recipe, when its "
                        "final value is the target, trains its whole budget); learning rates still follow the "
                        "schedule of each recipe's whole budget")
    q.add_argument("--devices", help="train the recipes side by side, one at a time on each of these devices (e.g. "
                                     "cuda:0,cuda:1,cuda:2,cuda:3; default: one after another on --device)")
    q.add_argument("--resume", action="store_true",
                   help="continue the stopped comparison in --out: the same command with --resume (its recipes that "
                        "ended are kept, the one training goes on from its last evaluation; one not yet trained may take "
                        "another budget or configuration)")


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep: its size's name, the training config it builds (model, execution,
    optimizer), the batch, the mode, and whose model (ours, or hf: the Hugging Face peer)."""

    size: str
    config: Config
    batch_size: int
    mode: str
    impl: str = "ours"

    @property
    def cfg(self) -> ModelConfig:
        return self.config.model

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    @property
    def attn(self) -> str:
        return self.config.execution.attn

    @property
    def label(self) -> str:
        ex = self.config.execution
        who = "hf-llama" if self.impl == "hf" else ex.attn
        return (f"{self.size} T={self.context_length} B={self.batch_size} {who} {ex.dtype} "
                f"compile={'on' if ex.compile else 'off'} {self.mode}"
                + (" cuda-graph" if ex.cuda_graph else "")
                + (" opt-overlap" if self.overlapped else "")
                + (f" fp8={ex.fp8}" if ex.fp8 != "off" else "")
                + (f" {self.config.optim.optimizer}" if self.config.optim.optimizer != "adamw" else ""))

    @property
    def overlapped(self) -> bool:
        """Our optimizer steps during the backward (a train-step in one process, not clipped); the peer keeps the
        plain step a user of it would run."""
        return self.impl == "ours" and self.mode == "train-step" and overlaps_backward(self.config)

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return re.sub(r"[^A-Za-z0-9.=_-]+", "_", self.label.replace(" ", "_"))


def _positive_ints(p: argparse.ArgumentParser, flag: str, values: list[str]) -> list[int]:
    out = []
    for v in values:
        try:
            n = int(v)
        except ValueError:
            p.error(f"{flag}: {v!r} is not an integer")
        if n < 1:
            p.error(f"{flag}: values must be >= 1, got {n}")
        out.append(n)
    return out


def _choices(p: argparse.ArgumentParser, flag: str, values: list[str], valid: Sequence[str], what: str) -> list[str]:
    for v in values:
        if v not in valid:
            p.error(f"{flag}: unknown {what} {v!r}; valid: {', '.join(valid)}")
    if not values:
        p.error(f"{flag}: give at least one {what}")
    return list(dict.fromkeys(values))  # drop repeats, keep order


def _models(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, ModelConfig]:
    """The model of each --sizes entry (and 'custom'), without context length (each row sets its own)."""
    custom = {"--d-model": args.d_model, "--n-layers": args.n_layers, "--n-heads": args.n_heads, "--d-ff": args.d_ff}
    given = [k for k, v in custom.items() if v is not None]
    if given and len(given) < len(custom):
        missing = [k for k in custom if k not in given]
        p.error(f"a custom size needs all of --d-model --n-layers --n-heads --d-ff; missing {' '.join(missing)}")
    sizes = _split(args.sizes) if args.sizes else ([] if given else ["small"])
    sizes = _choices(p, "--sizes", sizes, list(PRESETS) + (["custom"] if given else []), "size") if sizes else []
    if given and "custom" not in sizes:
        sizes.append("custom")
    models = {}
    for size in sizes:
        try:
            shape = dict(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, d_ff=args.d_ff)
            models[size] = (ModelConfig(**shape, vocab_size=args.vocab_size, n_kv_heads=args.n_kv_heads)
                            if size == "custom" else
                            config_for(size, vocab_size=args.vocab_size, n_kv_heads=args.n_kv_heads))
        except ValueError as e:
            p.error(f"size {size!r}: {e}")
    return models


def _check_bench_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What is the benchmark's own to check: its lists, its modes, its profiling outputs."""
    if args.cuda_graph != "off":
        if args.mode != ["train-step"]:
            p.error(f"--cuda-graph captures the whole train step: use --mode train-step (got {','.join(args.mode)})")
        if args.warmup < GRAPH_WARMUP + 1:
            p.error(f"--cuda-graph needs --warmup >= {GRAPH_WARMUP + 1} ({GRAPH_WARMUP} eager steps, then the "
                    f"capture), got {args.warmup}")
    if args.optimizer != ["adamw"] and args.mode != ["train-step"]:
        p.error(f"--optimizer is the train step's: use --mode train-step (got {','.join(args.mode)})")
    if "hf" in args.impl:
        if args.parallel != "none":
            p.error("--impl hf is the one-GPU peer; drop --parallel")
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error("--impl hf needs transformers: pip install transformers")
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0), ("--vocab-size", args.vocab_size, 1),
                               ("--profile-steps", args.profile_steps, 1), ("--snapshot-steps", args.snapshot_steps, 1)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    if args.nvtx and (reason := nvtx.unavailable()):
        p.error(f"--nvtx: {reason}")
    if args.memory_snapshot and (reason := snapshot_unavailable(args.device)):
        p.error(reason)
    if args.parallel != "none":
        for flag, value in (("--profile", args.profile), ("--memory-snapshot", args.memory_snapshot),
                            ("--explain-memory", args.explain_memory)):
            if value:
                p.error(f"{flag} is for one device; drop --parallel (profile the one-GPU configuration)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Parse the list flags and reject bad values with one line naming the problem (exit status 2); every row's
    training configuration goes through training.config.resolve, as train.py's does."""
    args.mode = _choices(p, "--mode", _split(args.mode), (*MODES, QUALITY_MODE), "mode")
    args.attn = _choices(p, "--attn", _split(args.attn), [b.name for b in list_attention()], "attention backend")
    args.impl = _choices(p, "--impl", _split(args.impl), IMPLS, "implementation")
    args.fp8 = _choices(p, "--fp8", _split(args.fp8), list(fp8.RECIPES), "fp8 recipe")
    args.optimizer = _choices(p, "--optimizer", _split(args.optimizer), optimizer_names(), "optimizer")
    try:
        args.device = parse_device(args.device, args.parallel)
    except ConfigError as e:
        p.error(str(e))
    if QUALITY_MODE in args.mode:
        return check_quality_args(p, args)
    if args.devices:
        p.error(f"--devices spreads --mode {QUALITY_MODE}'s recipes over devices; --parallel runs one model on "
                "several GPUs")
    for name, value in SWEEP_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.context_lengths = _positive_ints(p, "--context-lengths", _split(args.context_lengths))
    args.dtype = _choices(p, "--dtype", _split(args.dtype), list(PRECISIONS), "dtype")
    _check_bench_flags(p, args)
    args.models = _models(p, args)
    args.world_size = 1
    if args.parallel != "none":
        try:
            _, args.world_size, _ = distributed.launch_env(args.parallel, script="bench_model.py")
        except DistributedError as e:
            p.error(str(e))
    args.points = sweep_points(p, args)
    return args


def check_quality_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """--mode time-to-quality's flags: the recipes, the budget, and one configuration for them all (each given flag
    overrides every recipe); args.quality holds the settings."""
    if args.mode != [QUALITY_MODE]:
        p.error(f"--mode {QUALITY_MODE} runs alone (got {','.join(args.mode)})")
    for flag, given, why in (("--parallel", args.parallel != "none", "it trains in one process"),
                             ("--impl hf", "hf" in args.impl, "it trains our model"),
                             ("--optimizer", args.optimizer != ["adamw"], "each recipe names its optimizer"),
                             ("--compile both", args.compile == "both", "pass on or off"),
                             ("--cuda-graph both", args.cuda_graph == "both", "pass on or off"),
                             ("--profile", args.profile, "profile a --mode train-step"),
                             ("--memory-snapshot", args.memory_snapshot, "profile a --mode train-step"),
                             ("--explain-memory", args.explain_memory, "explain a --mode train-step")):
        if given:
            p.error(f"{flag} does not apply to --mode {QUALITY_MODE}: {why}")
    lengths = _positive_ints(p, "--context-lengths", _split(args.context_lengths))
    dtypes = _choices(p, "--dtype", _split(args.dtype), list(PRECISIONS), "dtype") if args.dtype else []
    for flag, values in (("--attn", args.attn), ("--dtype", dtypes), ("--fp8", args.fp8), ("--context-lengths", lengths)):
        if len(values) > 1:
            p.error(f"{flag}: --mode {QUALITY_MODE} compares recipes on one configuration; give one value")
    for flag, value, least in (("--eval-interval-s", args.eval_interval_s, 0), ("--target-bpb", args.target_bpb, 0)):
        if value is not None and not value > least:
            p.error(f"{flag} must be > {least}, got {value:g}")
    for flag, value in (("--eval-batches", args.eval_batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    recipes = _split(args.recipes)
    for spec in recipes:
        if spec not in RECIPES and not Path(spec).is_file():
            p.error(f"--recipes: {spec!r} is neither a recipe ({', '.join(RECIPES)}) nor a JSON file")
    recipes, budgets_s = _recipe_budgets(p, recipes, _split(args.minutes))
    sizes = {k: m if not lengths else dataclasses.replace(m, context_length=lengths[0])
             for k, m in _models(p, args).items()}
    devices = quality_devices(p, args)
    if args.stop_at_target and len(devices) > 1 and args.target_bpb is None:
        p.error("--stop-at-target with --devices needs --target-bpb: side by side, the first recipe's final value is "
                "not known while the others train")
    if len(devices) == 1:  # one device: the recipes one after another on it
        args.device, devices = torch.device(devices[0]), ()
    try:
        args.quality = QualitySettings(sizes, recipes, args.data, budgets_s, args.eval_interval_s, args.target_bpb,
                                       args.seed, args.eval_batches, quality_overrides(args, dtypes),
                                       Path("runs") / ".token_cache", devices, resume=args.resume,
                                       stop_at_target=args.stop_at_target)
    except ConfigError as e:
        p.error(str(e))
    return args


def _recipe_budgets(p: argparse.ArgumentParser, recipes: list[str],
                    minutes: list[str]) -> tuple[list[str], tuple[float, ...]]:
    """--recipes, each once, and the seconds of training of each from --minutes (one value, or one per recipe)."""
    values = []
    for m in minutes:
        try:
            values.append(float(m))
        except ValueError:
            p.error(f"--minutes: {m!r} is not a number")
        if not 0 < values[-1] < math.inf:
            p.error(f"--minutes must be > 0 and finite, got {values[-1]:g}")
    if len(values) == 1:
        unique = list(dict.fromkeys(recipes))
        return unique, (60 * values[0],) * len(unique)
    if len(set(recipes)) < len(recipes):
        p.error("--minutes: one value per recipe needs each recipe once in --recipes")
    if len(values) != len(recipes):
        p.error(f"--minutes: give one value, or one for each of the {len(recipes)} --recipes; got {len(values)}")
    return recipes, tuple(60 * v for v in values)


def quality_devices(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """--devices, checked: each a device of --device's type (the recipes' configurations are resolved for it),
    each CUDA one visible and named once."""
    if args.devices is None:
        return ()
    devices = _split([args.devices])
    for name in devices:
        try:
            device = torch.device(name)
        except RuntimeError:
            p.error(f"--devices: {name!r} is not a device (cpu, cuda:0, ...)")
        if device.type != args.device.type:
            p.error(f"--devices: {name} is not a {args.device.type} device, as --device {args.device} is")
        if device.type == "cuda" and (device.index is None or device.index >= torch.cuda.device_count()):
            p.error(f"--devices: {name} is not one of the {torch.cuda.device_count()} GPUs visible (cuda:0, ...)")
    if len({d for d in devices if d != "cpu"}) < sum(d != "cpu" for d in devices):
        p.error("--devices: a GPU is named twice; each trains one recipe at a time")
    return tuple(devices)


def quality_overrides(args: argparse.Namespace, dtypes: list[str]) -> dict[tuple[str, str], Any]:
    """The flags given, as (section, field) values over every recipe; the others are each recipe's (or train.py's)."""
    on = {"on": True, "off": False}
    given = {("execution", "attn"): args.attn[0], ("execution", "device"): str(args.device),
             ("execution", "dtype"): dtypes[0] if dtypes else None,
             ("execution", "compile"): on.get(args.compile), ("execution", "cuda_graph"): on.get(args.cuda_graph),
             ("execution", "fp8"): args.fp8[0] if args.fp8 != ["off"] else None,
             ("optim", "grad_clip"): args.grad_clip, ("data", "batch_size"): args.batch_size,
             ("data", "data"): args.data, ("run", "seed"): args.seed, ("run", "eval_batches"): args.eval_batches}
    return {key: value for key, value in given.items() if value is not None}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = check_args(p, p.parse_args(argv))
    if args.resume and args.mode != [QUALITY_MODE]:
        p.error(f"--resume continues a stopped --mode {QUALITY_MODE}")
    if args.out is None and args.resume:
        p.error("--resume: give the --out of the stopped comparison")
    if args.out is None:
        args.out = str(new_out_dir(Path("runs/bench_model")))
    elif args.resume:
        if not quality_state.interrupted_in(Path(args.out)):
            p.error(f"--resume: --out {args.out} holds no stopped comparison ({quality_state.state_dir(Path(args.out))} "
                    "has no plan.json)")
    elif args.mode == [QUALITY_MODE] and quality_state.interrupted_in(Path(args.out)):
        p.error(f"--out {args.out} holds a stopped time-to-quality comparison: continue it with --resume, or give "
                "a new folder")
    elif not args.explain_precision and (problem := earlier_results(Path(args.out))):  # which writes no files
        p.error(problem)
    if args.mode == [QUALITY_MODE]:
        args.quality = dataclasses.replace(args.quality, out=Path(args.out))
    launcher = ["python"] if args.parallel == "none" else ["torchrun", "--nproc-per-node", str(args.world_size)]
    args.command = shlex.join([*launcher, "bench_model.py", *argv])  # recorded in results.md
    return args


def point_config(args: argparse.Namespace, model: ModelConfig, attn: str, dtype: str, compile_: bool, graph: bool,
                 fp8_recipe: str, optimizer: str, mode: str) -> Config:
    """A row's training configuration: train.py's, resolved by the same function; the batch is per GPU. A train-step
    clips as --grad-clip says (by default not: the optimizer then overlaps the backward wherever it can); the other
    modes never step the optimizer, and keep train.py's clipping so that it does not step inside their backward."""
    config = Config(model=model).replace(
        execution={"attn": attn, "dtype": dtype, "compile": compile_, "cuda_graph": graph, "fp8": fp8_recipe,
                   "parallel": args.parallel, "device": str(args.device)},
        optim={"optimizer": optimizer, **({"grad_clip": args.grad_clip} if mode == "train-step" else {})},
        data={"batch_size": args.batch_size * args.world_size})
    # Every rule but the backend's: a backend that cannot run a point gets an unsupported row when the point runs (the
    # sweep goes on), so the rules are checked with naive, which runs everything, in its place.
    resolved = resolve(config.replace(execution={"attn": "naive"}), world_size=args.world_size).config
    return resolved.replace(execution={"attn": attn})


def sweep_points(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Point]:
    """Every configuration, in the order they run: size, implementation and backend, dtype, compile, context,
    mode, CUDA graph, float8, optimizer. The peer has its own attention (SDPA) and optimizer (AdamW)."""
    on_off = {"off": [False], "on": [True], "both": [False, True]}
    variants = [("ours", attn) for attn in args.attn if "ours" in args.impl] + [("hf", "sdpa")] * ("hf" in args.impl)
    points = []
    for (size, model), (impl, attn), dtype, comp, t, mode, graph in itertools.product(
            args.models.items(), variants, args.dtype, on_off[args.compile], args.context_lengths, args.mode,
            on_off[args.cuda_graph]):
        ours = impl == "ours"
        for recipe, optimizer in itertools.product(args.fp8 if ours else ["off"], args.optimizer if ours else ["adamw"]):
            try:
                config = point_config(args, dataclasses.replace(model, context_length=t), attn, dtype, comp, graph,
                                      recipe, optimizer, mode)
            except (ConfigError, ValueError) as e:
                p.error(str(e))
            points.append(Point(size, config, args.batch_size, mode, impl))
    return points


# --- one training step, timed phase by phase --------------------------------------------------------------


def _phase(name: str, annotate: bool) -> ContextManager[None]:
    """An NVTX range (when --nvtx) plus, while profiling, a torch.profiler label on the trace."""
    if not annotate:
        return nvtx.range(name)
    stack = contextlib.ExitStack()
    stack.enter_context(nvtx.range(name))
    stack.enter_context(torch.profiler.record_function(name))
    return stack


@dataclass
class Runner:
    """One configuration's training step (training.step, as train.py builds it) and its timing phase by phase."""

    point: Point
    train: TrainingStep
    annotate: bool = False  # add torch.profiler labels to the phases

    @property
    def model(self) -> torch.nn.Module:
        return self.train.model  # TransformerLM, or HFLlama for the peer

    @property
    def device(self) -> torch.device:
        return self.train.device

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """One step of the point's mode; returns each phase's time in ms, synchronised at each boundary."""
        mode, sync, train = self.point.mode, self.device, self.train
        if train.graphed is not None:
            synchronize(sync)
            start = time.perf_counter()
            with _phase("step (CUDA graph)", self.annotate):
                train(ids, targets)
                synchronize(sync)
            return {"total": (time.perf_counter() - start) * 1e3}
        for p in self.model.parameters():  # set_to_none: backward writes fresh gradients, no accumulation
            p.grad = None
        times: dict[str, float] = {}
        synchronize(sync)
        start = time.perf_counter()
        with _phase("forward", self.annotate):
            with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
                loss = train.loss(ids, targets)
            synchronize(sync)
        t = time.perf_counter()
        times["forward"] = (t - start) * 1e3
        if mode != "forward":
            with _phase("backward", self.annotate):
                train.backward(loss)
                synchronize(sync)
            t, last = time.perf_counter(), t
            times["backward"] = (t - last) * 1e3
        if mode == "train-step":
            with _phase("optimizer", self.annotate):
                train.optimizer_step()
                train.optimizer.zero_grad(set_to_none=True)
                synchronize(sync)
            t, last = time.perf_counter(), t
            times["optimizer"] = (t - last) * 1e3
        times["total"] = (t - start) * 1e3
        return times


def build_runner(point: Point, device: torch.device, ctx: Optional[DistContext] = None) -> Runner:
    """The model built on `device` (no CPU init of a 2.7B model) and its step from training.step.build_step: the
    same recipe as train.py (compile, DDP/FSDP wrap under a distributed `ctx`, optimizer, CUDA graph), timed without
    the gradient norm."""
    with device:
        model = HFLlama(point.cfg) if point.impl == "hf" else TransformerLM(point.cfg, point.attn)
    if point.config.execution.compile:
        torch._dynamo.reset()  # fresh caches: no recompile limit or automatic-dynamic shapes across points
    return Runner(point, build_step(model, point.config, ctx, grad_norm=False, overlap=point.overlapped))


def random_batch(point: Point, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, each (batch, seq), uniform over the vocabulary."""
    shape = (point.batch_size, point.context_length)
    ids = torch.randint(point.cfg.vocab_size, shape, generator=generator).to(device)
    targets = torch.randint(point.cfg.vocab_size, shape, generator=generator).to(device)
    return ids, targets


# --- one configuration -----------------------------------------------------------------------------------


def base_row(point: Point, args: argparse.Namespace) -> dict[str, Any]:
    cfg, ex = point.cfg, point.config.execution
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(size=point.size, params=param_count(cfg),  # = num_params(), also for rows that never built it
               d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
               vocab_size=cfg.vocab_size, context_length=cfg.context_length, batch_size=point.batch_size,
               impl=point.impl, attn=ex.attn, dtype=ex.dtype, compile=ex.compile, mode=point.mode,
               cuda_graph=ex.cuda_graph, overlap_optimizer=point.overlapped, fp8=ex.fp8,
               optimizer=point.config.optim.optimizer, warmup=args.warmup, steps=args.steps)
    if args.parallel != "none":
        row.update({c: None for c in PARALLEL_COLUMNS}, parallel=args.parallel, world_size=args.world_size)
    return row


def _output_path(base: Path, point: Point, single: bool, suffix: str = "") -> Path:
    """`base` itself for a one-configuration sweep, else one entry per configuration beside or under it."""
    if single:
        return base
    if suffix:  # a file: name_<slug>.suffix
        return base.with_name(f"{base.stem}_{point.slug}{base.suffix or suffix}")
    return base / point.slug


def throughput(point: Point, total_ms: float, device: torch.device, n_devices: int = 1) -> dict[str, Any]:
    """tokens_per_s and mfu of `n_devices` devices, each running `point.batch_size` sequences in `total_ms`."""
    tokens_per_s = n_devices * point.batch_size * point.context_length / (total_ms / 1e3)
    util = mfu(point.cfg, tokens_per_s, device, context_length=point.context_length, n_devices=n_devices)
    # flops_per_token counts forward + backward (6N); a forward alone does a third of it.
    return {"tokens_per_s": tokens_per_s,
            "mfu": None if util is None else (util / 3 if point.mode == "forward" else util)}


def time_steps(runner: Runner, ids: torch.Tensor, targets: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then time --steps steps phase by phase: their means and deviations, tokens/s, MFU, peak memory."""
    device, graphed = args.device, runner.point.config.execution.cuda_graph
    with nvtx.range("warmup"):
        for i in range(args.warmup):
            if graphed and i == GRAPH_WARMUP:
                # From the capture on: a replay allocates nothing (its memory is the graph's pool, taken during
                # capture), so a peak reset after capture would miss the activations.
                reset_peak_memory(device)
            runner.step(ids, targets)
    if not graphed:
        reset_peak_memory(device)
    per_phase: dict[str, list[float]] = {}
    for i in range(args.steps):
        with nvtx.range(f"step {i}"):
            for phase, ms in runner.step(ids, targets).items():
                per_phase.setdefault(phase, []).append(ms)
    peak = peak_allocated_bytes(device)
    figures: dict[str, Any] = {"status": "ok"}
    for phase, times in per_phase.items():
        stats = summarize(times)
        figures[f"{phase}_ms_mean"], figures[f"{phase}_ms_std"] = stats.mean_ms, stats.std_ms
    figures.update(throughput(runner.point, figures["total_ms_mean"], device))
    figures["peak_mem_gib"] = None if peak is None else peak / GIB
    return figures


def profile_point(runner: Runner, ids: torch.Tensor, targets: torch.Tensor, args: argparse.Namespace,
                  single: bool) -> None:
    """--profile and --memory-snapshot over a few more steps, with what they found printed."""
    point, device = runner.point, args.device
    if args.profile:
        out = _output_path(Path(args.profile), point, single)
        runner.annotate = True
        result = profile_steps(lambda: runner.step(ids, targets), out, device, wait=1, warmup=1,
                               active=args.profile_steps, title=point.label)
        runner.annotate = False
        tqdm.write(kernel_markdown(result.rows, result.on_gpu, result.active_steps, top=15, title=point.label))
        tqdm.write(f"profile: Chrome trace {result.trace_path} (open in chrome://tracing or ui.perfetto.dev), "
                   f"table {result.table_path}")
    if args.memory_snapshot:
        path = _output_path(Path(args.memory_snapshot), point, single, suffix=".pickle")
        with record_memory_history(path):
            for _ in range(args.snapshot_steps):
                runner.step(ids, targets)
            synchronize(device)
        tqdm.write(format_peak(peak_report(load_snapshot(path), device.index or 0), top=12))
        tqdm.write(f"memory snapshot: {path} (drag it onto {VIEWER_URL}, or python -m profiling.memory_snapshot)")


def run_point(point: Point, args: argparse.Namespace, single: bool,
              ctx: Optional[DistContext] = None) -> dict[str, Any]:
    """Warm up, time `--steps` steps, then (as asked) profile, snapshot and explain memory. Returns the figures.

    With a distributed `ctx`, this rank's figures for the wrapped model on its own random batch.
    """
    device, ex = args.device, point.config.execution
    torch.manual_seed(args.seed)  # the same weights on every rank
    if point.mode in SAMPLING_MODES:
        # context_length is the prompt (prefill) or the KV cache (decode); a step makes a token per sequence.
        dtype = torch.bfloat16 if ex.dtype == "bf16" else torch.float32
        figures = sampling_figures(point.mode, point.impl, point.cfg, point.batch_size, point.context_length, dtype,
                                   ex.compile, device, args.steps, args.warmup, attn=ex.attn)
        peak = peak_allocated_bytes(device)
        return {"status": "ok", **figures, "peak_mem_gib": None if peak is None else peak / GIB}
    generator = torch.Generator().manual_seed(args.seed + (ctx.rank if ctx else 0))  # each rank its own tokens
    runner = build_runner(point, device, ctx)
    ids, targets = random_batch(point, device, generator)
    figures = time_steps(runner, ids, targets, args)
    profile_point(runner, ids, targets, args, single)
    if args.explain_memory and point.impl == "ours":  # the accounting describes our model
        figures["explanation"] = explain_point(point, runner, ids, targets, figures["peak_mem_gib"])
        tqdm.write(figures["explanation"])
    return figures


def explain_point(point: Point, runner: Runner, ids: torch.Tensor, targets: torch.Tensor,
                  measured_peak_gib: Optional[float]) -> str:
    """The expected-bytes table beside the measured peak and the measured bytes autograd saved (eager forward)."""
    ex = point.config.execution
    breakdown = explain_memory(point.cfg, point.batch_size, point.context_length, ex.dtype, point.mode,
                               device_type=runner.device.type, attn=ex.attn, optimizer=point.config.optim.optimizer)
    measured: list[tuple[str, Optional[int]]] = []
    if point.mode != "forward":
        # A compiled model saves what inductor chose; the accounting describes the eager model (force_eager also
        # runs the blocks that compile_regions compiled in place without their compiled code).
        with torch.compiler.set_stance("force_eager"):
            saved = measure_saved_bytes(lambda: runner.train.loss(ids, targets, model=runner.model),
                                        exclude=list(runner.model.parameters()))
        state = sum(s.nbytes for s in breakdown.state[0].terms if "autocast" in s.name)
        measured.append(("measured: saved for backward, eager (incl. autocast weight copies)", saved))
        measured.append(("  expected, same terms", breakdown.saved_bytes + state))
    peak = None if measured_peak_gib is None else int(measured_peak_gib * GIB)
    measured.append(("measured: peak allocated over the timed steps", peak))
    return format_breakdown(breakdown, measured)


def measure(point: Point, args: argparse.Namespace, single: bool, ctx: Optional[DistContext] = None) -> dict[str, Any]:
    """The row of one configuration: its figures, or OOM / unsupported / error with the reason."""
    row = base_row(point, args)
    unavailable = {s.name: s.reason for s in list_attention() if not s.available}
    if point.attn in unavailable:
        row.update(status="unsupported", message=unavailable[point.attn])
        return row
    try:
        outcome = call_catching_oom(lambda: run_point(point, args, single, ctx), label=point.label)
    except UnsupportedInputError as e:
        row.update(status="unsupported", message=str(e))
    except Exception as e:  # noqa: BLE001 -- one broken configuration must not lose the rest of a long sweep
        row.update(status="error", message=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    else:
        if outcome.oom:
            row.update(status=OOM_STATUS, message=outcome.message)
        else:
            row.update(outcome.value)
    free_memory()
    return row


def measure_parallel(point: Point, args: argparse.Namespace, ctx: DistContext) -> dict[str, Any]:
    """One configuration under --parallel: rank 0 alone with the plain model (the one-GPU baseline), then every
    rank with the wrapped model. Every rank must call it; the row is complete on rank 0."""
    baseline = None
    if ctx.is_main:  # the other ranks wait at the barrier meanwhile
        # The same config (its optimizer not overlapped, as under DDP) on the plain model of one process.
        baseline = measure(point, replace_parallel(args), single=False)
    distributed.barrier(ctx)
    row = measure(point, args, single=False, ctx=ctx)
    # Every rank takes the same branch, so the collectives below match up.
    if distributed.any_rank(row["status"] != "ok", ctx):
        if row["status"] == "ok":
            row.update({k: None for k in COLUMNS if k.endswith(("_mean", "_std"))}, tokens_per_s=None, mfu=None,
                       peak_mem_gib=None, status="error", message="failed on another rank (see its output)")
        return row
    # The ranks step in lockstep through the collectives; the slowest rank's figures bound the throughput.
    figures = {k: v for k, v in row.items() if k.endswith(("_mean", "_std")) or k == "peak_mem_gib"}
    row.update(distributed.max_over_ranks({k: v for k, v in figures.items() if v is not None}, ctx))
    row.update(throughput(point, row["total_ms_mean"], args.device, n_devices=ctx.world_size))
    if baseline is not None:
        if baseline["status"] == "ok":
            row["tokens_per_s_1gpu"] = baseline["tokens_per_s"]
            row["scaling_efficiency"] = row["tokens_per_s"] / (ctx.world_size * baseline["tokens_per_s"])
        else:  # e.g. OOM on one GPU, the case FSDP is for: the row keeps its N-GPU figures
            row["message"] = f"1-GPU baseline {baseline['status']}: {baseline.get('message') or ''}"
    return row


def replace_parallel(args: argparse.Namespace) -> argparse.Namespace:
    """`args` for the one-device baseline: --parallel none."""
    return argparse.Namespace(**{**vars(args), "parallel": "none", "world_size": 1})


# --- main ------------------------------------------------------------------------------------------------


def explain_precision(args: argparse.Namespace) -> None:
    """--explain-precision: benchmarking/precision_report.py's tables for each size and dtype, printed."""
    for size, model_config in args.models.items():
        for dtype in args.dtype:
            for recipe in args.fp8:
                torch.manual_seed(args.seed)
                model = TransformerLM(model_config, args.attn[0]).to(args.device)
                if recipe != "off":
                    fp8.convert(model, recipe, args.device)
                title = f"{size}{f', --fp8 {recipe}' if recipe != 'off' else ''}"
                print(f"# {title}\n\n{precision_report.report(model, dtype, args.device)}\n")


def sweep(points: list[Point], args: argparse.Namespace, ctx: DistContext, env: dict[str, Any]
          ) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Measure every point: (rows, None), or (the rows so far, why) when Ctrl-C or SIGTERM ended it early; the
    configuration being measured then is left out. results.csv holds the rows so far."""
    rows: list[dict[str, Any]] = []
    current: list[str] = []  # the label of the configuration being measured
    progress = Progress(len(points), "bench_model", unit="config", every_s=60.0, enabled=ctx.is_main)

    def stopped(reason: str) -> str:
        if not ctx.is_main:  # rank 0 alone prints and writes files
            return f"stopped by {reason}"
        return note_interrupted(len(rows), len(points), reason, f"the configuration {current[0]}" if current else "")

    def write_so_far(reason: str) -> None:  # the watchdog's: the main thread is held inside a call of this point
        note = stopped(reason)
        if ctx.is_main:
            paths = write_outputs(list(rows), args, env, stopped=note, plots=False)
            tell(f"wrote {', '.join(str(p) for p in paths.values())}")

    try:  # Ctrl-C or SIGTERM (a time limit) ends the sweep early; the rows so far are still written
        with stops_promptly(write_so_far):
            for point in points:
                current[:] = [point.label]
                progress.report(point.label)
                row = (measure_parallel(point, args, ctx) if ctx.is_distributed
                       else measure(point, args, single=len(points) == 1))
                rows.append(row)
                current.clear()
                if ctx.is_main:
                    progress.write(summary_line(row, point.label))
                progress.update(1)
                if ctx.is_main:
                    report.write_csv(rows, Path(args.out) / "results.csv", columns=columns_for(args))
        return rows, None
    except KeyboardInterrupt as interrupt:
        progress.close()
        return rows, stopped(stop_reason(interrupt))
    finally:
        progress.close()


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Run the sweep described by `argv`; returns one row per configuration (also written to --out)."""
    args = parse_args(argv)
    if args.explain_precision:
        explain_precision(args)
        return []
    if args.mode == [QUALITY_MODE]:
        return time_to_quality(args)
    nvtx.enable(args.nvtx)
    ranks = contextlib.ExitStack()
    try:
        ctx = ranks.enter_context(join_ranks(args))
        say = tqdm.write if ctx.is_main else _quiet
        env = environment_info(args.device)
        say(f"bench_model: {len(args.points)} configurations on {describe(env)}"
            f"{f', {args.parallel} over {ctx.world_size} ranks' if ctx.is_distributed else ''}; writing {args.out}")
        rows, stopped = sweep(args.points, args, ctx, env)
        if ctx.is_main:
            paths = write_outputs(rows, args, env, stopped)
            if args.wandb:
                images = {name: p for name, p in paths.items() if name.endswith(".png")}
                report.log_wandb(rows, mode=args.wandb, project="flash-lm", run_name="bench_model", images=images,
                                 config=run_config(args), environment=env, directory=Path(args.out))
            say(f"wrote {', '.join(str(p) for p in paths.values())}")
        if stopped is not None:
            raise SystemExit(STOPPED_STATUS)  # the files hold the rows so far; the status says the sweep is incomplete
        return rows
    finally:
        ranks.close()
        nvtx.enable(False)


def time_to_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--mode time-to-quality: each recipe trained for the budget (benchmarking/quality.py); one row per size and
    recipe, the files in --out; exit 130 after a Ctrl-C or SIGTERM, the files holding what was measured."""
    from benchmarking import quality, quality_report
    from training.data import DataError

    settings, env = args.quality, environment_info(args.device)
    print(f"bench_model: time to quality of {', '.join(map(quality.recipe_label, settings.recipes))} on "
          f"{', '.join(settings.sizes)}, {settings.budget_words()}, on {describe(env)}; writing "
          f"{args.out}", flush=True)
    try:
        outcomes, interrupted = quality.compare(settings, lambda line: print(line, flush=True))
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2 if isinstance(e, ConfigError) else 1) from None
    table = quality_report.rows(outcomes, settings)
    paths = quality_report.write_outputs(table, outcomes, settings, args.command, env, Path(args.out))
    print("\n".join(quality_report.verdicts(table)))
    if args.wandb:
        curves = [{k: p.get(k) for k in quality_report.CURVE_COLUMNS} for o in outcomes for p in o.points]
        report.log_wandb(table, mode=args.wandb, project="flash-lm", run_name="time-to-quality",
                         images={n: p for n, p in paths.items() if n.endswith(".png")}, config={"command": args.command},
                         environment=env, directory=Path(args.out), tables={"curves": curves})
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if interrupted:
        note_interrupted(sum(o.status != "interrupted" for o in outcomes), len(settings.sizes) * len(settings.recipes))
        raise SystemExit(130)
    return table


@contextlib.contextmanager
def join_ranks(args: argparse.Namespace) -> Iterator[DistContext]:
    """One process (--parallel none), or this rank in torchrun's group; args.device becomes the rank's device."""
    if args.parallel == "none":
        yield DistContext(device=args.device)
        return
    try:
        ctx = distributed.init(args.parallel, str(args.device), BENCH_DIST_TIMEOUT_S, script="bench_model.py")
    except DistributedError as e:
        print(f"{distributed.error_prefix(args.parallel)}error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    args.device = ctx.device
    try:
        yield ctx
    finally:
        distributed.shutdown(ctx)


def _quiet(*args: Any, **kwargs: Any) -> None:
    """tqdm.write of ranks other than 0."""




if __name__ == "__main__":
    results = main()
    sys.exit(1 if any(r["status"] == "error" for r in results) else 0)
