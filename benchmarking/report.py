"""Writing benchmark results: markdown tables a person reads, CSV, JSON, PNG plots, optional W&B.

Everything here is generic over rows: a row is a flat dict (column -> number, string, bool or None).
None means "no figure" (an OOM row has no time) and is written as an empty cell / JSON null.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from training.run.files import write_atomic

Row = Mapping[str, Any]
Columns = Union[Sequence[str], Mapping[str, str]]  # keys, or key -> header text
Cell = Union[str, Callable[[Row], str]]


# --- values and columns ---------------------------------------------------------------------------


def format_value(value: Any, fmt: Optional[str] = None) -> str:
    """Text for a table cell: '' for None/NaN, `fmt` (e.g. '.2f') when given, else 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if fmt:
            return format(value, fmt)
        if value == 0 or math.isinf(value):
            return str(value)
        magnitude = abs(value)
        if 1e-3 <= magnitude < 1e5:
            digits = max(0, 3 - int(math.floor(math.log10(magnitude))))
            return f"{value:.{digits}f}"
        return f"{value:.3g}"
    if fmt and isinstance(value, int):
        return format(value, fmt)
    return str(value)


def collect_columns(rows: Iterable[Row]) -> list[str]:
    """Every key of every row, in order of first appearance."""
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def _headers(columns: Columns) -> tuple[list[str], list[str]]:
    if isinstance(columns, Mapping):
        return list(columns), list(columns.values())
    return list(columns), list(columns)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def unique_in_order(rows: Iterable[Row], key: str) -> list[Any]:
    """Distinct values of `key` across rows, in order of first appearance (rows lacking it skipped)."""
    seen: dict[Any, None] = {}
    for row in rows:
        if key in row:
            seen.setdefault(row[key], None)
    return list(seen)


def _write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically: a sweep killed while rewriting its results after a point (SIGKILL, the
    watchdog of benchmarking/interruption.py) leaves the previous complete file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: f.write(text.encode()))
    return path


# --- markdown ---------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[Row], columns: Columns, formats: Optional[Mapping[str, str]] = None) -> str:
    """A GitHub markdown table of `rows`, one line per row, cells via `format_value`."""
    keys, headers = _headers(columns)
    formats = formats or {}
    lines = ["| " + " | ".join(_escape(h) for h in headers) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [_escape(format_value(row.get(k), formats.get(k))) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def value_or_status(key: str, fmt: Optional[str] = None, status_key: str = "status") -> Callable[[Row], str]:
    """Cell function: the row's `key` formatted, or its status (e.g. 'OOM') when the value is missing."""

    def cell(row: Row) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            status = row.get(status_key)
            return "" if status in (None, "ok") else str(status)
        return format_value(value, fmt)

    return cell


def pivot_markdown(rows: Sequence[Row], index: str, columns: str, cell: Cell,
                   index_label: Optional[str] = None, column_label: Optional[str] = None) -> str:
    """Table with one line per value of `index`, one column per value of `columns` (e.g. seq x d_head).

    `cell` is a row key or a function row -> text. A combination with no row is left empty; if several
    rows share a combination the last one wins, so filter `rows` first (one backend, one dtype, ...).
    """
    cell_fn = value_or_status(cell) if isinstance(cell, str) else cell
    index_values, column_values = unique_in_order(rows, index), unique_in_order(rows, columns)
    grid = {(row.get(index), row.get(columns)): cell_fn(row) for row in rows}
    corner = f"{index_label or index} \\ {column_label or columns}"
    lines = ["| " + " | ".join([corner] + [format_value(c) for c in column_values]) + " |",
             "|" + "---|" * (len(column_values) + 1)]
    for i in index_values:
        cells = [_escape(grid.get((i, c), "")) for c in column_values]
        lines.append("| " + " | ".join([format_value(i)] + cells) + " |")
    return "\n".join(lines)


def environment_markdown(info: Mapping[str, Any]) -> str:
    """The environment dict as a two-column table, skipping empty values."""
    rows = [{"key": k, "value": v} for k, v in info.items() if v not in (None, "")]
    return markdown_table(rows, {"key": "", "value": ""})


def write_markdown(path: Path | str, title: str, blocks: Sequence[str],
                   environment: Optional[Mapping[str, Any]] = None) -> Path:
    """Write '# title', each block separated by a blank line, then an '## Environment' table."""
    parts = [f"# {title}", *blocks]
    if environment:
        parts += ["## Environment", environment_markdown(environment)]
    return _write_text(Path(path), "\n\n".join(p.rstrip() for p in parts) + "\n")


# --- csv / json ---------------------------------------------------------------------------------------


def write_csv(rows: Sequence[Row], path: Path | str, columns: Optional[Sequence[str]] = None) -> Path:
    """CSV with a header line; columns default to every key seen; None becomes an empty field."""
    columns = list(columns) if columns is not None else collect_columns(rows)
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return _write_text(Path(path), text.getvalue())


def read_csv(path: Path | str) -> list[dict[str, str]]:
    """Rows of a CSV written by `write_csv`, values as text (empty string for None)."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # Path, torch.dtype, device, ...


def write_json(rows: Sequence[Row], path: Path | str, environment: Optional[Mapping[str, Any]] = None,
               config: Optional[Mapping[str, Any]] = None, extra: Optional[Mapping[str, Any]] = None) -> Path:
    """JSON object {"environment": ..., "config": ..., "rows": [...], **extra}; non-JSON values become strings."""
    payload = {"environment": environment or {}, "config": config or {}, "rows": list(rows), **(extra or {})}
    return _write_text(Path(path), json.dumps(_jsonable(payload), indent=1) + "\n")


# --- plots ----------------------------------------------------------------------------------------------


def plot_lines(rows: Sequence[Row], x: str, y: str, series: str, path: Path | str, *,
               facet: Optional[str] = None, title: str = "", xlabel: Optional[str] = None,
               ylabel: Optional[str] = None, logx: bool = False, logy: bool = False) -> Optional[Path]:
    """PNG of `y` against `x`, one line per value of `series`; one subplot per value of `facet`, if given.

    Rows whose x or y is missing (OOM, unsupported) are left out, so a line stops where its backend
    ran out of memory. Returns the path, or None when no row has a value to plot.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    def has_value(row: Row) -> bool:
        return all(isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool)
                   and math.isfinite(row.get(k)) and (row.get(k) > 0 or not log)
                   for k, log in ((x, logx), (y, logy)))

    plotted = [r for r in rows if has_value(r)]
    if not plotted:
        return None
    facets = unique_in_order(plotted, facet) if facet else [None]
    columns = min(len(facets), 4)
    n_rows = math.ceil(len(facets) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(4.5 * columns, 3.6 * n_rows), squeeze=False)
    all_series = unique_in_order(plotted, series)
    colours = {s: f"C{i % 10}" for i, s in enumerate(all_series)}
    for ax, facet_value in zip(axes.flat, facets):
        subset = [r for r in plotted if facet is None or r.get(facet) == facet_value]
        for name in all_series:
            line = sorted((r[x], r[y]) for r in subset if r.get(series) == name)
            if line:
                ax.plot(*zip(*line), marker="o", markersize=3, label=str(name), color=colours[name])
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        if facet is not None:
            ax.set_title(f"{facet}={format_value(facet_value)}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(facets):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- weights & biases -----------------------------------------------------------------------------------


def log_wandb(rows: Sequence[Row], *, mode: str, project: str, run_name: Optional[str] = None,
              images: Optional[Mapping[str, Path | str]] = None, config: Optional[Mapping[str, Any]] = None,
              environment: Optional[Mapping[str, Any]] = None, directory: Optional[Path | str] = None,
              table_name: str = "results", tables: Optional[Mapping[str, Sequence[Row]]] = None) -> Optional[str]:
    """Log rows as a W&B table, any further `tables` (name -> rows) and `images` (name -> PNG path) in one run;
    returns the run's local dir.

    mode: 'offline' (written under `directory`, sync later with `wandb sync`) or 'online'.
    """
    if mode not in ("offline", "online"):
        raise ValueError(f"wandb mode must be 'offline' or 'online', got {mode!r}")
    import wandb

    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
    if wandb.run is not None:  # one run per call, whatever this wandb version's `reinit` default is
        wandb.run.finish()
    run = wandb.init(project=project, name=run_name, mode=mode, dir=str(directory) if directory else None,
                     config={**(config or {}), "environment": dict(environment or {})})
    try:
        payload: dict[str, Any] = {}
        for name, table in {table_name: rows, **(tables or {})}.items():
            columns = collect_columns(table)
            payload[name] = wandb.Table(columns=columns, data=[[_jsonable(r.get(c)) for c in columns] for r in table])
        for name, image in (images or {}).items():
            payload[name] = wandb.Image(str(image))
        run.log(payload)
        return run.dir
    finally:
        run.finish()
