"""Benchmark the whole Transformer LM: forward, backward and AdamW step times, tokens/s, MFU and peak memory.

Sweeps sizes x context lengths x attention backends x dtypes x compile x modes on random tokens; an OOM is a
result, not a crash. Writes results.md / results.csv / results.json / PNG plots to --out; --nvtx, --profile and
--memory-snapshot make the same runs easy to profile, --explain-memory prints where the bytes go.

    python bench_model.py --sizes small,medium --context-lengths 128,256,512,1024 --dtype fp32,bf16 \\
        --mode forward-backward

On several GPUs (weak scaling: --batch-size sequences per GPU), with scaling efficiency against one GPU:

    torchrun --standalone --nproc-per-node 2 bench_model.py --parallel ddp --sizes large --dtype bf16 --mode train-step
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from tqdm import tqdm

from attention import UnsupportedInputError, backend_names, list_attention
from benchmarking import report
from benchmarking.environment import describe, environment_info
from benchmarking.hf_llama import HFLlama
from benchmarking.interruption import note_interrupted, sigterm_as_interrupt
from benchmarking.model_memory import explain_memory, format_breakdown, measure_saved_bytes, param_count
from benchmarking.oom import OOM_STATUS, call_catching_oom, free_memory
from benchmarking.timing import peak_allocated_bytes, reset_peak_memory, summarize, synchronize
from model import PRESETS, ModelConfig, TransformerLM, config_for
from profiling import nvtx
from profiling.memory_snapshot import VIEWER_URL, format_peak, peak_report, record_memory_history, snapshot_unavailable
from profiling.torch_profile import kernel_markdown, profile_steps
from training import distributed
from training.compilation import COMPILE_SCOPES, compile_regions
from training.cuda_graph import GraphedStep
from training.distributed import DistContext, DistributedError
from training.metrics import mfu
from training.overlapped_optimizer import OverlappedOptimizer, step_partitions

DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # bf16 = autocast over fp32 master weights
IMPLS = ("ours", "hf")
MODES = ("forward", "forward-backward", "train-step")
PHASES = ("forward", "backward", "optimizer", "total")
GIB = 1024**3
GRAPH_WARMUP = 2  # eager steps before a CUDA graph is captured (compile and autotune happen in the first)

# Every column of results.csv / results.json, with what it means (the README lists these).
COLUMNS: dict[str, str] = {
    "size": "preset name, or 'custom' for --d-model/--n-layers/--n-heads/--d-ff",
    "params": "parameter count, TransformerLM.num_params()",
    "d_model": "model width",
    "n_layers": "blocks",
    "n_heads": "attention heads",
    "d_ff": "SwiGLU hidden size",
    "vocab_size": "vocabulary",
    "context_length": "tokens per sequence T",
    "batch_size": "sequences per step B",
    "impl": "ours (TransformerLM) or hf (the peer: transformers' LlamaForCausalLM, same sizes, SDPA attention)",
    "attn": "attention backend",
    "dtype": "fp32, or bf16 autocast with fp32 master weights",
    "compile": "torch.compile on the model: per block and LM head + loss (--compile-scope blocks) or whole model",
    "mode": "forward (no grad), forward-backward, or train-step (forward + backward + AdamW)",
    "cuda_graph": "train-step replayed as one CUDA graph (training.cuda_graph); its phases are then not split, and "
                  "peak memory counts from the capture on (a replay allocates nothing: it runs in the graph's pool)",
    "overlap_optimizer": "AdamW stepped parameter by parameter during the backward, on a second stream "
                         "(training.overlapped_optimizer); the backward phase then includes most of the optimizer",
    "status": "ok, OOM, unsupported (the backend cannot run it here) or error",
    **{f"{p}_ms_{s}": f"{p} time per step, ms ({'mean' if s == 'mean' else 'sample std'} over --steps)"
       for p in PHASES for s in ("mean", "std")},
    "tokens_per_s": "batch_size * context_length / mean total step time",
    "mfu": "model FLOPs utilisation vs the GPU's dense bf16 peak (training.metrics.mfu); forward counts 1/3",
    "peak_mem_gib": "peak allocated CUDA memory over the timed steps, GiB (empty on CPU)",
    "warmup": "untimed steps before timing",
    "steps": "timed steps",
    "message": "why a row has no figures (OOM / unsupported / error text)",
}

# Added after COLUMNS under --parallel ddp|fsdp (a --parallel none run writes exactly COLUMNS).
PARALLEL_COLUMNS: dict[str, str] = {
    "parallel": "ddp or fsdp; batch_size is then per GPU, the phase times and peak memory the largest over ranks",
    "world_size": "ranks (GPUs) N",
    "tokens_per_s_1gpu": "tokens/s of the plain model on rank 0 alone, same per-GPU batch (the baseline)",
    "scaling_efficiency": "tokens_per_s / (world_size * tokens_per_s_1gpu); 1.0 = perfect weak scaling",
}


def columns_for(args: argparse.Namespace) -> list[str]:
    """The columns of this run's results.csv / results.json."""
    return list(COLUMNS) + (list(PARALLEL_COLUMNS) if args.parallel != "none" else [])


# --- arguments -------------------------------------------------------------------------------------------


def _split(values: Optional[Sequence[str]]) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']: lists may be comma-separated, space-separated or both."""
    return [v.strip() for item in values or () for v in item.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("what to run")
    m.add_argument("--sizes", nargs="+", help=f"size presets, comma list: {', '.join(PRESETS)} (default small)")
    m.add_argument("--d-model", type=int, help="custom size: width (with --n-layers --n-heads --d-ff; named 'custom')")
    m.add_argument("--n-layers", type=int, help="custom size: blocks")
    m.add_argument("--n-heads", type=int, help="custom size: attention heads")
    m.add_argument("--d-ff", type=int, help="custom size: SwiGLU hidden size")
    m.add_argument("--vocab-size", type=int, default=10_000, help="vocabulary (default 10000)")
    m.add_argument("--context-lengths", nargs="+", default=["128,256,512,1024"],
                   help="context lengths, comma list (default 128,256,512,1024)")
    m.add_argument("--batch-size", type=int, default=4,
                   help="sequences per step (default 4); with --parallel, per GPU (weak scaling: each rank gets "
                        "--batch-size sequences, the global batch is N x --batch-size)")
    m.add_argument("--attn", nargs="+", default=["sdpa"], help="attention backends, comma list (default sdpa)")
    m.add_argument("--weight-grads", choices=["fp32", "autocast"], default="fp32",
                   help="under bf16 autocast, Linear weight gradients written in fp32 by their matmul (default) or "
                        "as plain autocast does (bf16, then cast); ours only")
    m.add_argument("--dtype", nargs="+", default=["fp32"], help="fp32 and/or bf16 (autocast), comma list")
    m.add_argument("--impl", nargs="+", default=["ours"],
                   help=f"{', '.join(IMPLS)}; comma list (default ours). hf is the peer, transformers' Llama "
                        "(needs transformers): same sizes, step, optimizer and tokens, timed in the same run")
    m.add_argument("--compile", nargs="?", const="on", default="off", choices=["on", "off", "both"],
                   help="torch.compile the model: on, off (default) or both; a bare --compile means on")
    m.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="blocks",
                   help="what --compile compiles: blocks (default: each block, reusing one graph, and the LM head "
                        "with the loss, as torchtitan) or model (the whole model as one graph)")
    m.add_argument("--cuda-graph", nargs="?", const="on", default="off", choices=["on", "off", "both"],
                   help="replay the whole train-step (forward, backward, AdamW) as one CUDA graph: on, off (default) "
                        "or both; removes the host's time per step. Needs --mode train-step, a GPU and --warmup >= 3")
    m.add_argument("--overlap-optimizer", nargs="?", const="on", default="off", choices=["on", "off", "both"],
                   help="step AdamW parameter by parameter during the backward, on a second CUDA stream "
                        "(training/overlapped_optimizer.py): on, off (default) or both; ours, --mode train-step, "
                        "one device")
    m.add_argument("--mode", nargs="+", default=["forward-backward"],
                   help=f"{', '.join(MODES)}; comma list (default forward-backward)")
    m.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    m.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    m.add_argument("--seed", type=int, default=0, help="seed for init and the random tokens")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda if available, else cpu)")
    d = p.add_argument_group("several GPUs (launch with torchrun)")
    d.add_argument("--parallel", choices=distributed.PARALLEL_MODES, default="none",
                   help="none (default): one device; ddp or fsdp: every torchrun rank runs the wrapped model, after "
                        "a one-GPU baseline on rank 0, and rows report scaling efficiency")
    d.add_argument("--dist-timeout", type=float, default=1800,
                   help="seconds a rank waits at a collective (the other ranks wait out rank 0's baseline) "
                        "(default 1800)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="runs/bench_model", help="directory for results.md/.csv/.json and plots")
    o.add_argument("--wandb", choices=["offline", "online"], help="also log the table and plots to W&B")
    o.add_argument("--wandb-project", default="flash-lm", help="W&B project")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    pr = p.add_argument_group("profiling")
    pr.add_argument("--nvtx", action="store_true",
                    help="NVTX ranges (warmup, step, forward, backward, optimizer, naive attention's phases) for nsys")
    pr.add_argument("--profile", metavar="DIR",
                    help="torch.profiler over a few steps: DIR/trace.json (Chrome trace) and DIR/kernels.md")
    pr.add_argument("--profile-steps", type=int, default=3, help="active (recorded) profiler steps (default 3)")
    pr.add_argument("--memory-snapshot", metavar="FILE",
                    help=f"CUDA memory history over a few steps, dumped to FILE (a pickle for {VIEWER_URL})")
    pr.add_argument("--snapshot-steps", type=int, default=3, help="steps recorded in the memory snapshot (default 3)")
    pr.add_argument("--snapshot-max-entries", type=int, default=100_000,
                    help="allocation events kept by the memory history (default 100000)")
    pr.add_argument("--explain-memory", action="store_true",
                    help="print expected bytes (parameters, gradients, AdamW state, activations) beside the measured")
    return p


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    size: str
    cfg: ModelConfig  # attn and context_length already set
    batch_size: int
    dtype: str
    compile: bool
    mode: str
    compile_scope: str = "blocks"  # what compile compiles: training.compilation.COMPILE_SCOPES
    impl: str = "ours"  # ours, or hf: the Hugging Face peer (whole-model compile, its own SDPA attention)
    cuda_graph: bool = False  # the train-step captured once and replayed (training.cuda_graph)
    overlap_optimizer: bool = False  # AdamW stepped during the backward (training.overlapped_optimizer)

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    @property
    def label(self) -> str:
        who = "hf-llama" if self.impl == "hf" else self.cfg.attn
        return (f"{self.size} T={self.context_length} B={self.batch_size} {who} {self.dtype} "
                f"compile={self.compile_scope if self.compile else 'off'} {self.mode}"
                + (" cuda-graph" if self.cuda_graph else "")
                + (" opt-overlap" if self.overlap_optimizer else "")
                + ("" if self.cfg.fp32_weight_grads or self.impl == "hf" else " dW=autocast"))

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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Parse the list flags and reject bad values with a message naming the problem (exit status 2)."""
    args.context_lengths = _positive_ints(p, "--context-lengths", _split(args.context_lengths))
    args.attn = _choices(p, "--attn", _split(args.attn), backend_names(), "attention backend")
    args.dtype = _choices(p, "--dtype", _split(args.dtype), list(DTYPES), "dtype")
    args.mode = _choices(p, "--mode", _split(args.mode), MODES, "mode")
    args.impl = _choices(p, "--impl", _split(args.impl), IMPLS, "implementation")
    if args.cuda_graph != "off":
        if args.mode != ["train-step"]:
            p.error(f"--cuda-graph captures the whole train step: use --mode train-step (got {','.join(args.mode)})")
        if args.parallel != "none":
            p.error("--cuda-graph is for one device; drop --parallel")
        if args.warmup < GRAPH_WARMUP + 1:
            p.error(f"--cuda-graph needs --warmup >= {GRAPH_WARMUP + 1} ({GRAPH_WARMUP} eager steps, then the "
                    f"capture), got {args.warmup}")
    if args.overlap_optimizer != "off":
        if args.mode != ["train-step"]:
            p.error(f"--overlap-optimizer steps the optimizer inside the backward: use --mode train-step "
                    f"(got {','.join(args.mode)})")
        if args.parallel != "none":
            p.error("--overlap-optimizer is for one device (DDP and FSDP reduce gradients after its hooks); "
                    "drop --parallel")
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

    custom = {"--d-model": args.d_model, "--n-layers": args.n_layers, "--n-heads": args.n_heads, "--d-ff": args.d_ff}
    given = [k for k, v in custom.items() if v is not None]
    if given and len(given) < len(custom):
        missing = [k for k in custom if k not in given]
        p.error(f"a custom size needs all of --d-model --n-layers --n-heads --d-ff; missing {' '.join(missing)}")
    sizes = _split(args.sizes) if args.sizes else ([] if given else ["small"])
    args.sizes = _choices(p, "--sizes", sizes, list(PRESETS) + (["custom"] if given else []), "size") if sizes else []
    if given and "custom" not in args.sizes:
        args.sizes.append("custom")
    args.configs = {}
    shared = {"vocab_size": args.vocab_size, "fp32_weight_grads": args.weight_grads == "fp32"}
    for size in args.sizes:
        try:
            if size == "custom":
                args.configs[size] = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                                                 d_ff=args.d_ff, **shared)
            else:
                args.configs[size] = config_for(size, **shared)
        except ValueError as e:
            p.error(f"size {size!r}: {e}")

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False")
    if args.cuda_graph != "off" and device.type != "cuda":
        p.error(f"--cuda-graph needs a CUDA device, got --device {device}")
    args.device = device
    if args.nvtx:
        reason = nvtx.unavailable()
        if reason:
            p.error(f"--nvtx: {reason}")
    if args.memory_snapshot:
        reason = snapshot_unavailable(device)
        if reason:
            p.error(reason)
    args.world_size = 1
    if args.parallel != "none":
        for flag, value in (("--profile", args.profile), ("--memory-snapshot", args.memory_snapshot),
                            ("--explain-memory", args.explain_memory)):
            if value:
                p.error(f"{flag} is for one device; drop --parallel (profile the one-GPU configuration)")
        if args.dist_timeout <= 0:
            p.error(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
        try:
            _, args.world_size, _ = distributed.launch_env(args.parallel, script="bench_model.py")
        except DistributedError as e:
            p.error(str(e))
    return args


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = check_args(p, p.parse_args(argv))
    launcher = ["python"] if args.parallel == "none" else ["torchrun", "--nproc-per-node", str(args.world_size)]
    args.command = shlex.join([*launcher, "bench_model.py", *argv])  # recorded in results.md
    return args


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-friendly values (results.json, W&B config)."""
    config = {k: v for k, v in vars(args).items() if k != "configs"}
    config["device"] = str(args.device)
    config["configs"] = {k: c.to_dict() for k, c in args.configs.items()}
    return config


def sweep_points(args: argparse.Namespace) -> list[Point]:
    """Every configuration, in the order they run: size, backend, dtype, compile, context, mode."""
    on_off = {"off": [False], "on": [True], "both": [False, True]}  # --compile and --cuda-graph
    compiles, graphs = on_off[args.compile], on_off[args.cuda_graph]
    overlaps = on_off[args.overlap_optimizer]
    # The peer has its own attention (SDPA) and is compiled whole, as a user would: one row per other setting.
    variants = [("ours", attn) for attn in args.attn if "ours" in args.impl] + [("hf", "sdpa")] * ("hf" in args.impl)
    # The overlapped optimizer is ours: the peer keeps its plain AdamW step.
    return [
        Point(size, replace(args.configs[size], attn=attn, context_length=t), args.batch_size, dtype, comp, mode,
              "model" if impl == "hf" else args.compile_scope, impl, graph, overlap)
        for size in args.sizes for impl, attn in variants for dtype in args.dtype for comp in compiles
        for t in args.context_lengths for mode in args.mode for graph in graphs
        for overlap in (overlaps if impl == "ours" else [False])
    ]


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
    """Model, optimizer and the step function of one configuration.

    `model` owns the parameters; `step_model` is what forward calls (the compiled and, later, a DDP/FSDP-wrapped
    model): a parallel variant only has to build a different `step_model` (and shard the data), not a new step.
    """

    point: Point
    model: torch.nn.Module  # TransformerLM, or HFLlama for the peer
    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, targets) -> loss
    optimizer: Optional[torch.optim.Optimizer | OverlappedOptimizer]
    device: torch.device
    annotate: bool = False  # add torch.profiler labels to the phases
    graphed: Optional[GraphedStep] = None  # the train-step as a CUDA graph (point.cuda_graph)

    def autocast(self) -> ContextManager[None]:
        dtype = DTYPES[self.point.dtype]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32, computed inside the model (and its compiled code), as train.py's lm_loss."""
        with self.autocast():
            return self.step_model(ids, targets)

    def train_step(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        """Forward, backward and AdamW step, without synchronising: what the CUDA graph captures."""
        loss = self.loss(ids, targets)
        loss.backward()
        self.optimizer.step()
        return (loss.detach(),)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """One step of the point's mode; returns each phase's time in ms, synchronised at each boundary."""
        mode, sync = self.point.mode, self.device
        if self.graphed is not None:
            synchronize(sync)
            start = time.perf_counter()
            with _phase("step (CUDA graph)", self.annotate):
                self.graphed(ids, targets)
                synchronize(sync)
            return {"total": (time.perf_counter() - start) * 1e3}
        for p in self.model.parameters():  # set_to_none: backward writes fresh gradients, no accumulation
            p.grad = None
        times: dict[str, float] = {}
        synchronize(sync)
        start = time.perf_counter()
        with _phase("forward", self.annotate):
            with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
                loss = self.loss(ids, targets)
            synchronize(sync)
        t = time.perf_counter()
        times["forward"] = (t - start) * 1e3
        if mode != "forward":
            with _phase("backward", self.annotate):
                loss.backward()
                synchronize(sync)
            t, last = time.perf_counter(), t
            times["backward"] = (t - last) * 1e3
        if mode == "train-step":
            with _phase("optimizer", self.annotate):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                synchronize(sync)
            t, last = time.perf_counter(), t
            times["optimizer"] = (t - last) * 1e3
        times["total"] = (t - start) * 1e3
        return times


def build_runner(point: Point, device: torch.device, ctx: Optional[DistContext] = None) -> Runner:
    """The model on `device` (built there: no CPU init of a 2.7B model), compiled if asked, and its optimizer.

    As train.py: compile scope blocks compiles the blocks and the loss in place before a distributed `ctx` wraps the
    model (DDP / FSDP2), scope model compiles the wrapped model; the optimizer comes last (FSDP replaces the
    parameters by their shards).
    """
    with device:
        model = HFLlama(point.cfg) if point.impl == "hf" else TransformerLM(point.cfg)
    if point.compile:
        torch._dynamo.reset()  # fresh caches: no recompile limit or automatic-dynamic shapes across points
        if point.compile_scope == "blocks" and point.impl == "ours":
            compile_regions(model, dynamic=False)
    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = model
    if ctx is not None and ctx.is_distributed:
        step_model = distributed.wrap_model(model, ctx, DTYPES[point.dtype])
    if point.compile and point.compile_scope == "model":
        step_model = torch.compile(step_model, dynamic=False)
    optimizer = None
    if point.mode == "train-step":  # capturable: the step count on the GPU, so a CUDA graph can replay the step
        def adamw(params) -> torch.optim.AdamW:
            return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda", capturable=point.cuda_graph)

        optimizer = (OverlappedOptimizer(step_partitions(model), adamw) if point.overlap_optimizer
                     else adamw(model.parameters()))
    runner = Runner(point, model, step_model, optimizer, device)
    if point.cuda_graph:
        runner.graphed = GraphedStep(runner.train_step, optimizer, warmup=GRAPH_WARMUP)
    return runner


def random_batch(point: Point, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, each (batch, seq), uniform over the vocabulary."""
    shape = (point.batch_size, point.context_length)
    ids = torch.randint(point.cfg.vocab_size, shape, generator=generator).to(device)
    targets = torch.randint(point.cfg.vocab_size, shape, generator=generator).to(device)
    return ids, targets


# --- one configuration -----------------------------------------------------------------------------------


def base_row(point: Point, args: argparse.Namespace) -> dict[str, Any]:
    cfg = point.cfg
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(size=point.size, params=param_count(cfg),  # = num_params(), also for rows that never built it
               d_model=cfg.d_model, n_layers=cfg.n_layers,
               n_heads=cfg.n_heads, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, context_length=cfg.context_length,
               batch_size=point.batch_size, impl=point.impl, attn=cfg.attn, dtype=point.dtype, compile=point.compile,
               mode=point.mode, cuda_graph=point.cuda_graph, overlap_optimizer=point.overlap_optimizer,
               warmup=args.warmup, steps=args.steps)
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


def run_point(point: Point, args: argparse.Namespace, single: bool,
              ctx: Optional[DistContext] = None) -> dict[str, Any]:
    """Warm up, time `--steps` steps, then (as asked) profile, snapshot and explain memory. Returns the figures.

    With a distributed `ctx`, this rank's figures for the wrapped model on its own random batch.
    """
    device = args.device
    torch.manual_seed(args.seed)  # the same weights on every rank
    generator = torch.Generator().manual_seed(args.seed + (ctx.rank if ctx else 0))  # each rank its own tokens
    runner = build_runner(point, device, ctx)
    ids, targets = random_batch(point, device, generator)

    with nvtx.range("warmup"):
        for i in range(args.warmup):
            if point.cuda_graph and i == GRAPH_WARMUP:
                # From the capture on: a replay allocates nothing (its memory is the graph's pool, taken during
                # capture), so a peak reset after capture would miss the activations.
                reset_peak_memory(device)
            runner.step(ids, targets)
    if not point.cuda_graph:
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
    figures.update(throughput(point, figures["total_ms_mean"], device))
    figures["peak_mem_gib"] = None if peak is None else peak / GIB

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
        with record_memory_history(path, max_entries=args.snapshot_max_entries):
            for _ in range(args.snapshot_steps):
                runner.step(ids, targets)
            synchronize(device)
        tqdm.write(format_peak(peak_report(pickle.loads(path.read_bytes()), device.index or 0), top=12))
        tqdm.write(f"memory snapshot: {path} (drag it onto {VIEWER_URL}, or python -m profiling.memory_snapshot)")
    if args.explain_memory and point.impl == "ours":  # the accounting describes our model
        figures["explanation"] = explain_point(point, runner, ids, targets, peak)
        tqdm.write(figures["explanation"])
    return figures


def explain_point(point: Point, runner: Runner, ids: torch.Tensor, targets: torch.Tensor,
                  measured_peak: Optional[int]) -> str:
    """The expected-bytes table beside the measured peak and the measured bytes autograd saved (eager forward)."""
    breakdown = explain_memory(point.cfg, point.batch_size, point.context_length, point.dtype, point.mode,
                               device_type=runner.device.type)
    measured: list[tuple[str, Optional[int]]] = []
    if point.mode != "forward":
        # A compiled model saves what inductor chose; the accounting describes the eager model (force_eager also
        # runs the blocks that compile_regions compiled in place without their compiled code).
        eager = replace(runner, step_model=runner.model)
        with torch.compiler.set_stance("force_eager"):
            saved = measure_saved_bytes(lambda: eager.loss(ids, targets), exclude=list(runner.model.parameters()))
        state = sum(s.nbytes for s in breakdown.state[0].terms if "autocast" in s.name)
        measured.append(("measured: saved for backward, eager (incl. autocast weight copies)", saved))
        measured.append(("  expected, same terms", breakdown.saved_bytes + state))
    measured.append(("measured: peak allocated over the timed steps", measured_peak))
    return format_breakdown(breakdown, measured)


def measure(point: Point, args: argparse.Namespace, single: bool, ctx: Optional[DistContext] = None) -> dict[str, Any]:
    """The row of one configuration: its figures, or OOM / unsupported / error with the reason."""
    row = base_row(point, args)
    unavailable = {s.name: s.reason for s in list_attention() if not s.available}
    if point.cfg.attn in unavailable:
        row.update(status="unsupported", message=unavailable[point.cfg.attn])
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


# --- output ----------------------------------------------------------------------------------------------


def _mean_std(row: dict[str, Any], phase: str) -> Optional[str]:
    mean, std = row.get(f"{phase}_ms_mean"), row.get(f"{phase}_ms_std")
    return None if mean is None else f"{mean:.2f} ± {std:.2f}"


def results_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> list[str]:
    """The blocks of results.md: settings, one line per configuration, then size x context pivots."""
    shown = []
    for r in rows:
        d = dict(r)
        d["params_m"] = r["params"] / 1e6
        for phase in PHASES:
            d[phase] = _mean_std(r, phase)
        d["mfu_pct"] = None if r.get("mfu") is None else 100 * r["mfu"]
        d["status"] = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('message') or ''}"
        shown.append(d)
    columns = {"size": "size", "params_m": "params (M)", "context_length": "T", "impl": "impl", "attn": "attn", "dtype": "dtype",
               "compile": "compile", "mode": "mode", "cuda_graph": "CUDA graph", "overlap_optimizer": "opt overlap",
               "forward": "forward ms", "backward": "backward ms",
               "optimizer": "optimizer ms", "total": "total ms", "tokens_per_s": "tokens/s", "mfu_pct": "MFU %",
               "peak_mem_gib": "peak GiB", "status": "status"}
    blocks = [
        f"`{args.command}`",
        f"Batch {args.batch_size}{' per GPU' if args.parallel != 'none' else ''}, vocab {args.vocab_size}, "
        f"{args.warmup} warm-up + {args.steps} timed steps per "
        f"configuration, random tokens; {describe(env)}. Times are mean ± sample std, each phase synchronised.",
        report.markdown_table(shown, columns, formats={"params_m": ".1f", "tokens_per_s": ".0f", "mfu_pct": ".1f",
                                                        "peak_mem_gib": ".2f"}),
    ]
    for key, group in _variants(rows).items():
        blocks.append(f"## Total step ms, {key}")
        blocks.append(report.pivot_markdown(group, "size", "context_length",
                                            report.value_or_status("total_ms_mean", ".2f"), column_label="T"))
        if any(r.get("peak_mem_gib") is not None for r in group):
            blocks.append(f"## Peak memory GiB, {key}")
            blocks.append(report.pivot_markdown(group, "size", "context_length",
                                                report.value_or_status("peak_mem_gib", ".2f"), column_label="T"))
    if args.parallel != "none":
        blocks.append(f"## Scaling, {args.parallel} over {args.world_size} GPUs")
        blocks.append(f"Batch {args.batch_size} per GPU (weak scaling); efficiency = tokens/s on {args.world_size} "
                      f"GPUs / ({args.world_size} x tokens/s of the plain model on one GPU).")
        scaling = [{**r, "config": f"{r['size']} T={r['context_length']} {_variant(r)}"} for r in rows]
        blocks.append(report.markdown_table(
            scaling, {"config": "config", "world_size": "world size", "tokens_per_s_1gpu": "tokens/s 1 GPU",
                      "tokens_per_s": f"tokens/s {args.world_size} GPUs", "scaling_efficiency": "efficiency"},
            formats={"tokens_per_s_1gpu": ".0f", "tokens_per_s": ".0f", "scaling_efficiency": ".3f"}))
    explained = [r["explanation"] for r in rows if r.get("explanation")]
    if explained:
        blocks.append("## Memory accounting (--explain-memory)")
        blocks += [f"```\n{e}\n```" for e in explained]
    return blocks


def _variant(row: dict[str, Any]) -> str:
    who = "hf-llama" if row.get("impl") == "hf" else row["attn"]
    graph = " cuda-graph" if row.get("cuda_graph") else ""
    overlap = " opt-overlap" if row.get("overlap_optimizer") else ""
    return f"{who} {row['dtype']} compile={'on' if row['compile'] else 'off'} {row['mode']}{graph}{overlap}"


def _variants(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_variant(r), []).append(r)
    return groups


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Path]:
    """results.md, results.csv, results.json and the PNG plots in --out; returns name -> path."""
    out = Path(args.out)
    config = run_config(args)
    columns = columns_for(args)
    paths = {
        "results.md": report.write_markdown(out / "results.md", "Model benchmark", results_markdown(rows, args, env),
                                            environment=env),
        "results.csv": report.write_csv(rows, out / "results.csv", columns=columns),
        "results.json": report.write_json([{k: r.get(k) for k in columns} for r in rows], out / "results.json",
                                          environment=env, config=config),
    }
    plot_rows = [{**r, "variant": _variant(r).rsplit(" ", 1)[0]} for r in rows]
    for mode in args.mode:
        subset = [r for r in plot_rows if r["mode"] == mode]
        for name, y, label in (("step_time", "total_ms_mean", "step time (ms)"),
                               ("memory", "peak_mem_gib", "peak memory (GiB)")):
            path = report.plot_lines(subset, "context_length", y, "variant", out / f"{name}_{mode}.png",
                                     facet="size", title=f"{label} vs context, {mode}, batch {args.batch_size}",
                                     xlabel="context length", ylabel=label, logx=True, logy=True)
            if path is not None:
                paths[path.name] = path
    return paths


# --- main ------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Run the sweep described by `argv`; returns one row per configuration (also written to --out)."""
    args = parse_args(argv)
    nvtx.enable(args.nvtx)
    ranks = contextlib.ExitStack()
    try:
        ctx = ranks.enter_context(join_ranks(args))
        say = tqdm.write if ctx.is_main else _quiet  # rank 0 alone prints and writes files
        points = sweep_points(args)
        env = environment_info(args.device)
        say(f"bench_model: {len(points)} configurations on {describe(env)}"
            f"{f', {args.parallel} over {ctx.world_size} ranks' if ctx.is_distributed else ''}")
        rows = []
        try:  # Ctrl-C or SIGTERM (a time limit) ends the sweep early; the rows so far are still written
            with sigterm_as_interrupt():
                bar = tqdm(points, desc="bench_model", unit="config", disable=args.no_progress or not ctx.is_main,
                           dynamic_ncols=True)
                for point in bar:
                    bar.set_postfix_str(point.label)
                    row = (measure_parallel(point, args, ctx) if ctx.is_distributed
                           else measure(point, args, single=len(points) == 1))
                    rows.append(row)
                    say(_summary_line(row, point))
                    if ctx.is_main:
                        report.write_csv(rows, Path(args.out) / "results.csv", columns=columns_for(args))
            interrupted = False
        except KeyboardInterrupt:
            note_interrupted(len(rows), len(points))
            interrupted = True
        if ctx.is_main:
            paths = write_outputs(rows, args, env)
            if args.wandb:
                images = {name: p for name, p in paths.items() if name.endswith(".png")}
                report.log_wandb(rows, mode=args.wandb, project=args.wandb_project, run_name="bench_model",
                                 images=images, config=run_config(args),
                                 environment=env, directory=Path(args.out))
            say(f"wrote {', '.join(str(p) for p in paths.values())}")
        if interrupted:
            raise SystemExit(130)  # the files hold the rows so far; the status says the sweep is incomplete
        return rows
    finally:
        ranks.close()
        nvtx.enable(False)


@contextlib.contextmanager
def join_ranks(args: argparse.Namespace) -> Iterator[DistContext]:
    """One process (--parallel none), or this rank in torchrun's group; args.device becomes the rank's device."""
    if args.parallel == "none":
        yield DistContext(device=args.device)
        return
    try:
        ctx = distributed.init(args.parallel, str(args.device), args.batch_size * args.world_size, args.dist_timeout,
                               script="bench_model.py")
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


def _summary_line(row: dict[str, Any], point: Point) -> str:
    if row["status"] != "ok":
        return f"{point.label}: {row['status']} ({row.get('message')})"
    parts = [f"{p} {row[f'{p}_ms_mean']:.2f}±{row[f'{p}_ms_std']:.2f} ms" for p in PHASES
             if row.get(f"{p}_ms_mean") is not None]
    parts.append(f"{row['tokens_per_s']:.0f} tok/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("peak_mem_gib") is not None:
        parts.append(f"peak {row['peak_mem_gib']:.2f} GiB")
    if row.get("scaling_efficiency") is not None:
        parts.append(f"scaling efficiency {row['scaling_efficiency']:.2f} vs 1 GPU")
    return f"{point.label}: " + ", ".join(parts)


if __name__ == "__main__":
    results = main()
    sys.exit(1 if any(r["status"] == "error" for r in results) else 0)
