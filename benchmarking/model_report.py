"""bench_model.py's results: the columns of results.csv / results.json, results.md, the plots and the console line.

A row is one configuration of the sweep: its settings, status and figures (`COLUMNS`, plus `PARALLEL_COLUMNS`
under --parallel ddp|fsdp).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from benchmarking import report
from benchmarking.environment import describe

PHASES = ("forward", "backward", "optimizer", "total")

# Every column of results.csv / results.json, with what it means (docs/benchmarks.md lists these).
COLUMNS: dict[str, str] = {
    "size": "preset name, or 'custom' for --d-model/--n-layers/--n-heads/--d-ff",
    "params": "parameter count, TransformerLM.num_params()",
    "d_model": "model width",
    "n_layers": "blocks",
    "n_heads": "attention heads",
    "d_ff": "MLP hidden size",
    "vocab_size": "vocabulary",
    "context_length": "tokens per sequence T",
    "batch_size": "sequences per step B",
    "impl": "ours (TransformerLM) or hf (the peer: transformers' LlamaForCausalLM, same sizes, SDPA attention)",
    "attn": "attention backend",
    "dtype": "fp32, or bf16 autocast with fp32 master weights",
    "compile": "torch.compile: each block and the LM head with the loss (ours), the whole model (the peer)",
    "mode": "forward (no grad), forward-backward, or train-step (forward + backward + optimizer); prefill (a prompt of "
            "context_length tokens into the KV cache) or decode (a token per sequence against a cache of "
            "context_length), with weights in dtype",
    "cuda_graph": "train-step replayed as one CUDA graph (training.cuda_graph); its phases are then not split, and "
                  "peak memory counts from the capture on (a replay allocates nothing: it runs in the graph's pool)",
    "overlap_optimizer": "the optimizer stepped parameter by parameter during the backward, on a second stream "
                         "(training/optim/overlapped.py; a train-step is timed without clipping, so in one process it "
                         "does); the backward phase then includes most of the optimizer",
    "fp8": "off, or the blocks' Linear layers in float8 with tensorwise or rowwise scaling (training.fp8)",
    "optimizer": "ours: the optimizer by name (training/optim): adamw (fp32 moments, fused) or adamw-bf16 (bf16 "
                 "moments that also write the Linear weights' bf16 copies); the peer: adamw",
    "status": "ok, OOM, unsupported (the backend cannot run it here) or error",
    **{f"{p}_ms_{s}": f"{p} time per step, ms ({'mean' if s == 'mean' else 'sample std'} over --steps)"
       for p in PHASES for s in ("mean", "std")},
    "tokens_per_s": "batch_size * context_length / mean total step time",
    "mfu": "model FLOPs utilisation vs the GPU's dense bf16 peak (training.metrics.mfu); forward counts 1/3",
    "peak_mem_gib": "peak allocated CUDA memory over the timed steps, GiB (empty on CPU)",
    "warmup": "untimed steps before timing",
    "steps": "timed steps",
    "bandwidth_gbs": "decode: (weight bytes + KV-cache bytes read) per step / step time, GB/s",
    "bandwidth_fraction": "decode: bandwidth_gbs over the GPU's measured copy bandwidth",
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


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-friendly values (results.json, W&B config)."""
    config = {k: v for k, v in vars(args).items() if k not in ("models", "points")}  # the rows hold the points
    config["device"] = str(args.device)
    config["models"] = {k: c.to_dict() for k, c in args.models.items()}
    return config


def _mean_std(row: dict[str, Any], phase: str) -> Optional[str]:
    mean, std = row.get(f"{phase}_ms_mean"), row.get(f"{phase}_ms_std")
    return None if mean is None else f"{mean:.2f} ± {std:.2f}"


def results_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any],
                     stopped: Optional[str] = None) -> list[str]:
    """The blocks of results.md: settings, one line per configuration, then size x context pivots; `stopped` is the
    note of a sweep that Ctrl-C or SIGTERM ended early."""
    shown = []
    for r in rows:
        d = dict(r)
        d["params_m"] = r["params"] / 1e6
        for phase in PHASES:
            d[f"{phase}_ms"] = _mean_std(r, phase)
        d["mfu_pct"] = None if r.get("mfu") is None else 100 * r["mfu"]
        d["status"] = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('message') or ''}"
        shown.append(d)
    columns = {"size": "size", "params_m": "params (M)", "context_length": "T", "impl": "impl", "attn": "attn",
               "dtype": "dtype", "compile": "compile", "mode": "mode", "cuda_graph": "CUDA graph",
               "overlap_optimizer": "opt overlap", "fp8": "fp8", "optimizer": "optimizer", "forward_ms": "forward ms",
               "backward_ms": "backward ms", "optimizer_ms": "optimizer ms", "total_ms": "total ms",
               "tokens_per_s": "tokens/s", "mfu_pct": "MFU %",
               "peak_mem_gib": "peak GiB", "status": "status"}
    blocks = [
        f"`{args.command}`",
        f"Batch {args.batch_size}{' per GPU' if args.parallel != 'none' else ''}, vocab {args.vocab_size}, "
        f"{args.warmup} warm-up + {args.steps} timed steps per "
        f"configuration, random tokens; {describe(env)}. Times are mean ± sample std, each phase synchronised.",
        *([f"**Incomplete**: {stopped.removesuffix('; writing the results so far')}."] if stopped else []),
        report.markdown_table(shown, columns, formats={"params_m": ".1f", "tokens_per_s": ".0f", "mfu_pct": ".1f",
                                                        "peak_mem_gib": ".2f"}),
    ]
    for key, group in variants(rows).items():
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
        scaling = [{**r, "config": f"{r['size']} T={r['context_length']} {variant(r)}"} for r in rows]
        blocks.append(report.markdown_table(
            scaling, {"config": "config", "world_size": "world size", "tokens_per_s_1gpu": "tokens/s 1 GPU",
                      "tokens_per_s": f"tokens/s {args.world_size} GPUs", "scaling_efficiency": "efficiency"},
            formats={"tokens_per_s_1gpu": ".0f", "tokens_per_s": ".0f", "scaling_efficiency": ".3f"}))
    explained = [r["explanation"] for r in rows if r.get("explanation")]
    if explained:
        blocks.append("## Memory accounting (--explain-memory)")
        blocks += [f"```\n{e}\n```" for e in explained]
    return blocks


def variant(row: dict[str, Any]) -> str:
    who = "hf-llama" if row.get("impl") == "hf" else row["attn"]
    graph = " cuda-graph" if row.get("cuda_graph") else ""
    overlap = " opt-overlap" if row.get("overlap_optimizer") else ""
    fp8 = f" fp8={row['fp8']}" if row.get("fp8") not in (None, "off") else ""
    optimizer = f" {row['optimizer']}" if row.get("optimizer") not in (None, "adamw") else ""
    return f"{who} {row['dtype']} compile={'on' if row['compile'] else 'off'} {row['mode']}{graph}{overlap}{fp8}{optimizer}"


def variants(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(variant(r), []).append(r)
    return groups


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any],
                  stopped: Optional[str] = None, plots: bool = True) -> dict[str, Path]:
    """results.md, results.csv, results.json and (unless `plots` is False) the PNG plots in --out; returns name ->
    path. `stopped`: see results_markdown."""
    out = Path(args.out)
    config = run_config(args)
    columns = columns_for(args)
    paths = {
        "results.md": report.write_markdown(out / "results.md", "Model benchmark",
                                            results_markdown(rows, args, env, stopped), environment=env),
        "results.csv": report.write_csv(rows, out / "results.csv", columns=columns),
        "results.json": report.write_json([{k: r.get(k) for k in columns} for r in rows], out / "results.json",
                                          environment=env, config=config),
    }
    plot_rows = [{**r, "variant": variant(r).rsplit(" ", 1)[0]} for r in rows]
    for mode in args.mode if plots else ():
        subset = [r for r in plot_rows if r["mode"] == mode]
        for name, y, label in (("step_time", "total_ms_mean", "step time (ms)"),
                               ("memory", "peak_mem_gib", "peak memory (GiB)")):
            path = report.plot_lines(subset, "context_length", y, "variant", out / f"{name}_{mode}.png",
                                     facet="size", title=f"{label} vs context, {mode}, batch {args.batch_size}",
                                     xlabel="context length", ylabel=label, logx=True, logy=True)
            if path is not None:
                paths[path.name] = path
    return paths


def summary_line(row: dict[str, Any], label: str) -> str:
    """The one console line of a finished configuration."""
    if row["status"] != "ok":
        return f"{label}: {row['status']} ({row.get('message')})"
    parts = [f"{p} {row[f'{p}_ms_mean']:.2f}±{row[f'{p}_ms_std']:.2f} ms" for p in PHASES
             if row.get(f"{p}_ms_mean") is not None]
    parts.append(f"{row['tokens_per_s']:.0f} tok/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("bandwidth_gbs") is not None:
        parts.append(f"{row['bandwidth_gbs']:.0f} GB/s ({100 * row['bandwidth_fraction']:.0f}% of copy)")
    if row.get("peak_mem_gib") is not None:
        parts.append(f"peak {row['peak_mem_gib']:.2f} GiB")
    if row.get("scaling_efficiency") is not None:
        parts.append(f"scaling efficiency {row['scaling_efficiency']:.2f} vs 1 GPU")
    return f"{label}: " + ", ".join(parts)
