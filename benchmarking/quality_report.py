"""bench_model.py --mode time-to-quality's results: the target, one row per size and recipe, results.md / .csv /
.json, curves.csv, the curves' PNG, W&B and the console lines (benchmarking/quality.py measures)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarking import report
from benchmarking.model_memory import param_count
from benchmarking.quality import Outcome, QualitySettings, tokens_per_step, validation_rows
from training.metrics import mfu

# Every column of results.csv / results.json, with what it means (docs/benchmarks.md lists these).
COLUMNS: dict[str, str] = {
    "size": "model size preset (or custom)",
    "recipe": "recipe name (training/recipes.py) or JSON file stem",
    "optimizer": "the recipe's --optimizer",
    "lr": "its peak learning rate",
    "params": "parameter count",
    "context_length": "tokens per sequence",
    "batch_size": "sequences per step",
    "attn": "attention backend",
    "dtype": "compute precision",
    "compile": "regional torch.compile",
    "cuda_graph": "the step replayed as a CUDA graph",
    "budget_s": "seconds of training allowed (--minutes)",
    "train_s": "seconds of training done: the clock, evaluations excluded",
    "warmup_s": "seconds of the first steps (compile, graph capture), off the clock",
    "steps": "optimizer steps, the warm-up ones included",
    "tokens": "training tokens: steps x batch x context",
    "ms_per_step": "train_s / steps on the clock",
    "tokens_per_s": "tokens on the clock / train_s",
    "mfu": "model FLOPs utilisation at that speed (training.metrics.mfu; empty on the CPU)",
    "evals": "evaluations (at 0, every --eval-interval-s of training, and at the end)",
    "final_loss": "validation loss at the last evaluation (the end, or the stop of --stop-at-target), nats a token",
    "final_bpb": "validation bits per byte at the last evaluation",
    "best_bpb": "lowest validation bits per byte of the run",
    "target_bpb": "the target: --target-bpb, else the first recipe's final_bpb",
    "reached": "whether an evaluation reached the target (bits per byte at or below it)",
    "time_to_target_s": "seconds of training at the first evaluation at or below the target",
    "tokens_to_target": "training tokens at that evaluation",
    "steps_to_target": "steps at that evaluation",
    "speedup": "the first recipe's time_to_target_s over this recipe's (above 1: faster)",
    "status": "ok, diverged (a non-finite loss), interrupted, OOM or error",
    "message": "why, when status is not ok; or that --stop-at-target stopped it",
}
CURVE_COLUMNS = ("size", "recipe", "clock_s", "step", "tokens", "train_loss", "val_loss", "val_bpb")


def targets(outcomes: Sequence[Outcome], settings: QualitySettings) -> dict[str, tuple[Optional[float], str]]:
    """Per size: (the target bits per byte, where it comes from)."""
    out = {}
    for size in settings.sizes:
        if settings.target_bpb is not None:
            out[size] = (settings.target_bpb, "--target-bpb")
            continue
        first = next((o for o in outcomes if o.size == size), None)
        final = final_point(first) if first else None
        out[size] = (final["val_bpb"], f"{first.recipe}'s final value") if final else (None, "none: the first recipe "
                                                                                         "has no evaluation")
    return out


def final_point(outcome: Outcome) -> Optional[dict[str, Any]]:
    finite = [p for p in outcome.points if p["val_bpb"] is not None and math.isfinite(p["val_bpb"])]
    return finite[-1] if finite else None


def reach(outcome: Outcome, target: Optional[float]) -> Optional[dict[str, Any]]:
    """The first evaluation at or below `target`, or None."""
    if target is None:
        return None
    return next((p for p in outcome.points if p["val_bpb"] is not None and p["val_bpb"] <= target), None)


def row(outcome: Outcome, target: Optional[float], settings: QualitySettings) -> dict[str, Any]:
    """One size and recipe: its settings, speed, final and best figures, and when it reached the target."""
    r: dict[str, Any] = {c: None for c in COLUMNS}
    r.update(size=outcome.size, recipe=outcome.recipe, budget_s=settings.budget_s(outcome.recipe),
             status=outcome.status, message=outcome.message or None, target_bpb=target)
    c = outcome.config
    if c is not None:
        ex = c.execution
        r.update(optimizer=c.optim.optimizer, lr=c.optim.lr, params=param_count(c.model),
                 context_length=c.model.context_length, batch_size=c.data.batch_size, attn=ex.attn, dtype=ex.dtype,
                 compile=ex.compile, cuda_graph=ex.cuda_graph)
    per_step = tokens_per_step(c) if c else 0
    r.update(train_s=outcome.train_s, warmup_s=outcome.warmup_s, steps=outcome.steps,
             tokens=outcome.steps * per_step, evals=len(outcome.points))
    if outcome.timed_steps and outcome.train_s > 0:
        r["ms_per_step"] = 1e3 * outcome.train_s / outcome.timed_steps
        r["tokens_per_s"] = outcome.timed_steps * per_step / outcome.train_s
        r["mfu"] = mfu(c.model, r["tokens_per_s"], c.execution.device)
    final = final_point(outcome)
    if final:
        r.update(final_loss=final["val_loss"], final_bpb=final["val_bpb"],
                 best_bpb=min(p["val_bpb"] for p in outcome.points if p["val_bpb"] is not None))
    hit = reach(outcome, target)
    r["reached"] = hit is not None if target is not None else None
    if hit:
        r.update(time_to_target_s=hit["clock_s"], tokens_to_target=hit["tokens"], steps_to_target=hit["step"])
    return r


def rows(outcomes: Sequence[Outcome], settings: QualitySettings) -> list[dict[str, Any]]:
    """Every outcome's row, with its speed-up over the first recipe of its size."""
    goal = targets(outcomes, settings)
    out = [row(o, goal[o.size][0], settings) for o in outcomes]
    for r in out:
        first = next(f for f in out if f["size"] == r["size"])
        if r["time_to_target_s"] and first["time_to_target_s"]:
            r["speedup"] = first["time_to_target_s"] / r["time_to_target_s"]
    return out


def verdict(r: dict[str, Any], first: dict[str, Any]) -> str:
    """One line: when the recipe reached the target, or that it never did."""
    name = f"{r['size']} {r['recipe']}"
    why = f" [{r['status']}: {r['message']}]" if r["message"] else ""
    if r["target_bpb"] is None:
        return f"{name}: no target{why}"
    if not r["reached"]:
        final = f"final {r['final_bpb']:.4f} bpb" if r["final_bpb"] is not None else "no evaluation"
        return f"{name}: never reached {r['target_bpb']:.4f} bpb in {r['train_s']:.0f} s of training ({final}){why}"
    line = (f"{name}: reached {r['target_bpb']:.4f} bpb after {r['time_to_target_s']:.1f} s, "
            f"{r['tokens_to_target']:,} tokens, step {r['steps_to_target']}")
    if r is not first and r["speedup"]:
        line += f" ({r['speedup']:.2f}x the speed of {first['recipe']})"
    return line + why


def verdicts(table: Sequence[dict[str, Any]]) -> list[str]:
    return [verdict(r, next(f for f in table if f["size"] == r["size"])) for r in table]


def plot_curves(curves: Sequence[dict[str, Any]], goal: dict[str, tuple[Optional[float], str]],
                path: Path) -> Optional[Path]:
    """Bits per byte against seconds of training, one line per recipe, the target as a dashed horizontal line; a
    panel per size. None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report.unique_in_order(curves, "size")
    if not sizes:
        return None
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes.flat, sizes):
        for i, recipe in enumerate(report.unique_in_order([c for c in curves if c["size"] == size], "recipe")):
            line = [(c["clock_s"], c["val_bpb"]) for c in curves
                    if c["size"] == size and c["recipe"] == recipe and c["val_bpb"] is not None]
            ax.plot(*zip(*line), marker="o", markersize=3, color=f"C{i % 10}", label=recipe)
        target, source = goal.get(size, (None, ""))
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.4f} ({source})")
        ax.set(xlabel="seconds of training (evaluation excluded)", ylabel="validation bits per byte",
               title=f"time to quality, {size}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def settings_line(settings: QualitySettings, goal: dict[str, tuple[Optional[float], str]]) -> str:
    aims = "; ".join(f"{size}: {t:.4f} bpb ({src})" if t is not None else f"{size}: {src}"
                     for size, (t, src) in goal.items())
    where = (f" Recipes ran side by side, one at a time on each of {', '.join(settings.devices)}."
             if len(settings.devices) > 1 else "")
    if settings.stop_at_target:
        which = "Each recipe" if settings.target_bpb is not None else "Each recipe after the first"
        where += (f" {which} stopped at its first evaluation at or below the target (--stop-at-target), its learning "
                  "rate on the schedule of its whole budget.")
    elif settings.common_budget_s is None:
        where += " Each recipe's learning rate follows the schedule of its own budget."
    return (f"Data: {settings.data or 'the built-in corpus'}. Each recipe trains the same model from seed "
            f"{settings.seed} on the same batches for {settings.budget_words()} (the clock stops while it "
            f"evaluates; the first steps, which compile and capture, are timed apart), and is scored every "
            f"{settings.interval_s:g} s on the same {settings.eval_batches} validation batches of "
            f"{validation_rows(settings)} sequences.{where} Target: {aims}.")


MARKDOWN_COLUMNS = {"size": "size", "recipe": "recipe", "optimizer": "optimizer", "lr": "lr", "steps": "steps",
                    "ms_per_step": "ms/step", "mfu_pct": "MFU %", "final_bpb": "final bpb", "best_bpb": "best bpb",
                    "time_to_target_s": "s to target", "tokens_to_target": "tokens to target",
                    "speedup": "speed-up", "status": "status"}


def results_markdown(table: Sequence[dict[str, Any]], settings: QualitySettings, command: str,
                     goal: dict[str, tuple[Optional[float], str]], plot: Optional[Path]) -> list[str]:
    shown = [{**r, "mfu_pct": None if r["mfu"] is None else 100 * r["mfu"],
              "time_to_target_s": r["time_to_target_s"] if r["reached"] else "never",
              "status": f"{r['status']}: {r['message']}" if r["message"] else r["status"]} for r in table]
    columns = dict(MARKDOWN_COLUMNS)
    if settings.common_budget_s is None:  # each recipe its own budget: say which
        columns = {"size": "size", "recipe": "recipe", "budget_s": "budget s", **columns}
    blocks = [f"`{command}`", settings_line(settings, goal),
              report.markdown_table(shown, columns, formats={
                  "lr": "g", "ms_per_step": ".1f", "mfu_pct": ".1f", "final_bpb": ".4f", "best_bpb": ".4f",
                  "time_to_target_s": ".1f", "tokens_to_target": ",", "speedup": ".2f", "budget_s": "g"}),
              "\n".join(f"- {line}" for line in verdicts(table))]
    if plot is not None:
        blocks.append(f"![validation bits per byte against seconds of training]({plot.name})")
    return blocks


def write_outputs(table: list[dict[str, Any]], outcomes: Sequence[Outcome], settings: QualitySettings, command: str,
                  env: dict[str, Any], out: Path) -> dict[str, Path]:
    """results.md, results.csv, results.json (rows, curves, each recipe's resolved configuration), curves.csv and
    curves.png in `out`; returns name -> path."""
    goal = targets(outcomes, settings)
    curves = [{k: p.get(k) for k in CURVE_COLUMNS} for o in outcomes for p in o.points]
    plot = plot_curves(curves, goal, out / "curves.png")
    config = {"command": command, "sizes": {k: m.to_dict() for k, m in settings.sizes.items()},
              "recipes": settings.recipes, "data": settings.data, "budget_s": settings.budget_record,
              "interval_s": settings.interval_s, "target_bpb": settings.target_bpb,
              "stop_at_target": settings.stop_at_target, "seed": settings.seed, "eval_batches": settings.eval_batches,
              "overrides": {f"{s}.{f}": v for (s, f), v in settings.overrides.items()},
              "resolved": {f"{o.size} {o.recipe}": o.config.to_dict() for o in outcomes if o.config is not None}}
    paths = {
        "results.md": report.write_markdown(out / "results.md", "Time to quality",
                                            results_markdown(table, settings, command, goal, plot), environment=env),
        "results.csv": report.write_csv(table, out / "results.csv", columns=list(COLUMNS)),
        "results.json": report.write_json(table, out / "results.json", environment=env, config=config,
                                          extra={"curves": curves}),
        "curves.csv": report.write_csv(curves, out / "curves.csv", columns=list(CURVE_COLUMNS)),
    }
    if plot is not None:
        paths["curves.png"] = plot
    return paths
