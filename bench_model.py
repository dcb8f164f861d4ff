"""Benchmark the whole Transformer LM: forward, backward and AdamW step times, tokens/s, MFU and peak memory.

Sweeps sizes x context lengths x attention backends x dtypes x compile x modes on random tokens; an OOM is a
result, not a crash. Writes results.md / results.csv / results.json / PNG plots to --out; --nvtx, --profile and
--memory-snapshot make the same runs easy to profile, --explain-memory prints where the bytes go.

    python bench_model.py --sizes small,medium --context-lengths 128,256,512,1024 --dtype fp32,bf16 \\
        --mode forward-backward
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attention import UnsupportedInputError, backend_names, list_attention
from benchmarking import report
from benchmarking.environment import describe, environment_info
from benchmarking.interruption import note_interrupted, sigterm_as_interrupt
from benchmarking.model_memory import explain_memory, format_breakdown, measure_saved_bytes, param_count
from benchmarking.oom import OOM_STATUS, call_catching_oom, free_memory
from benchmarking.timing import peak_allocated_bytes, reset_peak_memory, summarize, synchronize
from model import PRESETS, ModelConfig, TransformerLM, config_for
from profiling import nvtx
from profiling.memory_snapshot import VIEWER_URL, record_memory_history, snapshot_unavailable
from profiling.torch_profile import kernel_markdown, profile_steps
from training.metrics import mfu

DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # bf16 = autocast over fp32 master weights
MODES = ("forward", "forward-backward", "train-step")
PHASES = ("forward", "backward", "optimizer", "total")
GIB = 1024**3

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
    "attn": "attention backend",
    "dtype": "fp32, or bf16 autocast with fp32 master weights",
    "compile": "torch.compile on the model",
    "mode": "forward (no grad), forward-backward, or train-step (forward + backward + AdamW)",
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
    m.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    m.add_argument("--attn", nargs="+", default=["sdpa"], help="attention backends, comma list (default sdpa)")
    m.add_argument("--dtype", nargs="+", default=["fp32"], help="fp32 and/or bf16 (autocast), comma list")
    m.add_argument("--compile", nargs="?", const="on", default="off", choices=["on", "off", "both"],
                   help="torch.compile the model: on, off (default) or both; a bare --compile means on")
    m.add_argument("--mode", nargs="+", default=["forward-backward"],
                   help=f"{', '.join(MODES)}; comma list (default forward-backward)")
    m.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    m.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    m.add_argument("--seed", type=int, default=0, help="seed for init and the random tokens")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda if available, else cpu)")
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

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    @property
    def label(self) -> str:
        return (f"{self.size} T={self.context_length} B={self.batch_size} {self.cfg.attn} {self.dtype} "
                f"compile={'on' if self.compile else 'off'} {self.mode}")

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
    for size in args.sizes:
        try:
            if size == "custom":
                args.configs[size] = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                                                 d_ff=args.d_ff, vocab_size=args.vocab_size)
            else:
                args.configs[size] = config_for(size, vocab_size=args.vocab_size)
        except ValueError as e:
            p.error(f"size {size!r}: {e}")

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False")
    args.device = device
    if args.nvtx:
        reason = nvtx.unavailable()
        if reason:
            p.error(f"--nvtx: {reason}")
    if args.memory_snapshot:
        reason = snapshot_unavailable(device)
        if reason:
            p.error(reason)
    return args


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = check_args(p, p.parse_args(argv))
    args.command = shlex.join(["python", "bench_model.py", *argv])  # recorded in results.md
    return args


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-friendly values (results.json, W&B config)."""
    config = {k: v for k, v in vars(args).items() if k != "configs"}
    config["device"] = str(args.device)
    config["configs"] = {k: c.to_dict() for k, c in args.configs.items()}
    return config


def sweep_points(args: argparse.Namespace) -> list[Point]:
    """Every configuration, in the order they run: size, backend, dtype, compile, context, mode."""
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    return [
        Point(size, replace(args.configs[size], attn=attn, context_length=t), args.batch_size, dtype, comp, mode)
        for size in args.sizes for attn in args.attn for dtype in args.dtype for comp in compiles
        for t in args.context_lengths for mode in args.mode
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
    model: TransformerLM
    step_model: Callable[[torch.Tensor], torch.Tensor]
    optimizer: Optional[torch.optim.Optimizer]
    device: torch.device
    annotate: bool = False  # add torch.profiler labels to the phases

    def autocast(self) -> ContextManager[None]:
        dtype = DTYPES[self.point.dtype]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy on the logits; as train.py, the loss itself runs in fp32 outside autocast."""
        with self.autocast():
            logits = self.step_model(ids)  # (batch, seq, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """One step of the point's mode; returns each phase's time in ms, synchronised at each boundary."""
        mode, sync = self.point.mode, self.device
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


def build_runner(point: Point, device: torch.device) -> Runner:
    """The model on `device` (built there: no CPU init of a 2.7B model), compiled if asked, and its optimizer."""
    with device:
        model = TransformerLM(point.cfg)
    step_model: Callable[[torch.Tensor], torch.Tensor] = model
    if point.compile:
        torch._dynamo.reset()  # fresh caches: no recompile limit or automatic-dynamic shapes across points
        step_model = torch.compile(model, dynamic=False)
    optimizer = None
    if point.mode == "train-step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return Runner(point, model, step_model, optimizer, device)


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
               batch_size=point.batch_size, attn=cfg.attn, dtype=point.dtype, compile=point.compile,
               mode=point.mode, warmup=args.warmup, steps=args.steps)
    return row


def _output_path(base: Path, point: Point, single: bool, suffix: str = "") -> Path:
    """`base` itself for a one-configuration sweep, else one entry per configuration beside or under it."""
    if single:
        return base
    if suffix:  # a file: name_<slug>.suffix
        return base.with_name(f"{base.stem}_{point.slug}{base.suffix or suffix}")
    return base / point.slug


def run_point(point: Point, args: argparse.Namespace, single: bool) -> dict[str, Any]:
    """Warm up, time `--steps` steps, then (as asked) profile, snapshot and explain memory. Returns the figures."""
    device = args.device
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    runner = build_runner(point, device)
    ids, targets = random_batch(point, device, generator)

    with nvtx.range("warmup"):
        for _ in range(args.warmup):
            runner.step(ids, targets)
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
    tokens_per_s = point.batch_size * point.context_length / (figures["total_ms_mean"] / 1e3)
    figures["tokens_per_s"] = tokens_per_s
    util = mfu(point.cfg, tokens_per_s, device, context_length=point.context_length)
    # flops_per_token counts forward + backward (6N); a forward alone does a third of it.
    figures["mfu"] = None if util is None else (util / 3 if point.mode == "forward" else util)
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
        tqdm.write(f"memory snapshot: {path} (drag it onto {VIEWER_URL})")
    if args.explain_memory:
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
        # A compiled model saves what inductor chose; the accounting describes the eager model.
        eager = replace(runner, step_model=runner.model)
        saved = measure_saved_bytes(lambda: eager.loss(ids, targets), exclude=list(runner.model.parameters()))
        state = sum(s.nbytes for s in breakdown.state[0].terms if "autocast" in s.name)
        measured.append(("measured: saved for backward, eager (incl. autocast weight copies)", saved))
        measured.append(("  expected, same terms", breakdown.saved_bytes + state))
    measured.append(("measured: peak allocated over the timed steps", measured_peak))
    return format_breakdown(breakdown, measured)


def measure(point: Point, args: argparse.Namespace, single: bool) -> dict[str, Any]:
    """The row of one configuration: its figures, or OOM / unsupported / error with the reason."""
    row = base_row(point, args)
    unavailable = {s.name: s.reason for s in list_attention() if not s.available}
    if point.cfg.attn in unavailable:
        row.update(status="unsupported", message=unavailable[point.cfg.attn])
        return row
    try:
        outcome = call_catching_oom(lambda: run_point(point, args, single), label=point.label)
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
    columns = {"size": "size", "params_m": "params (M)", "context_length": "T", "attn": "attn", "dtype": "dtype",
               "compile": "compile", "mode": "mode", "forward": "forward ms", "backward": "backward ms",
               "optimizer": "optimizer ms", "total": "total ms", "tokens_per_s": "tokens/s", "mfu_pct": "MFU %",
               "peak_mem_gib": "peak GiB", "status": "status"}
    blocks = [
        f"`{args.command}`",
        f"Batch {args.batch_size}, vocab {args.vocab_size}, {args.warmup} warm-up + {args.steps} timed steps per "
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
    explained = [r["explanation"] for r in rows if r.get("explanation")]
    if explained:
        blocks.append("## Memory accounting (--explain-memory)")
        blocks += [f"```\n{e}\n```" for e in explained]
    return blocks


def _variant(row: dict[str, Any]) -> str:
    return f"{row['attn']} {row['dtype']} compile={'on' if row['compile'] else 'off'} {row['mode']}"


def _variants(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_variant(r), []).append(r)
    return groups


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Path]:
    """results.md, results.csv, results.json and the PNG plots in --out; returns name -> path."""
    out = Path(args.out)
    config = run_config(args)
    paths = {
        "results.md": report.write_markdown(out / "results.md", "Model benchmark", results_markdown(rows, args, env),
                                            environment=env),
        "results.csv": report.write_csv(rows, out / "results.csv", columns=list(COLUMNS)),
        "results.json": report.write_json([{k: r.get(k) for k in COLUMNS} for r in rows], out / "results.json",
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
    try:
        points = sweep_points(args)
        env = environment_info(args.device)
        tqdm.write(f"bench_model: {len(points)} configurations on {describe(env)}")
        rows = []
        try:  # Ctrl-C or SIGTERM (a time limit) ends the sweep early; the rows so far are still written
            with sigterm_as_interrupt():
                bar = tqdm(points, desc="bench_model", unit="config", disable=args.no_progress, dynamic_ncols=True)
                for point in bar:
                    bar.set_postfix_str(point.label)
                    row = measure(point, args, single=len(points) == 1)
                    rows.append(row)
                    tqdm.write(_summary_line(row, point))
                    report.write_csv(rows, Path(args.out) / "results.csv", columns=list(COLUMNS))
            interrupted = False
        except KeyboardInterrupt:
            note_interrupted(len(rows), len(points))
            interrupted = True
        paths = write_outputs(rows, args, env)
        if args.wandb:
            images = {name: p for name, p in paths.items() if name.endswith(".png")}
            report.log_wandb(rows, mode=args.wandb, project=args.wandb_project, run_name="bench_model",
                             images=images, config=run_config(args),
                             environment=env, directory=Path(args.out))
        tqdm.write(f"wrote {', '.join(str(p) for p in paths.values())}")
        if interrupted:
            raise SystemExit(130)  # the files hold the rows so far; the status says the sweep is incomplete
        return rows
    finally:
        nvtx.enable(False)


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
    return f"{point.label}: " + ", ".join(parts)


if __name__ == "__main__":
    results = main()
    sys.exit(1 if any(r["status"] == "error" for r in results) else 0)
