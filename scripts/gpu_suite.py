"""Run the attention test suite on a CUDA GPU and record the outcome.

    python scripts/gpu_suite.py                       # -> results/h100/<date>-gpu-tests.json
    python scripts/gpu_suite.py --out results/h200/x.json --autotune -- -k flash -x
    python scripts/gpu_suite.py --out gpu-out/gpu-tests.json -- tests/attention -n 14   # pytest-xdist

With CUDA present the tests parametrize over float32, float16 and bfloat16 and include the GPU-only
checks (seq 4096 vs SDPA, tensors past 2^31 elements, every tile shape of the autotune space). Prints a
pass/fail table grouped by (test, dtype) and writes a JSON file with the GPU, the versions, the counts
and every test's outcome. Exits with pytest's status (0 when everything passed).

By default FLASH_ATTN_AUTOTUNE=0: each kernel runs one fixed config per head dim, because autotuning
every shape of the suite would compile hundreds of configs. --autotune turns tuning back on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/attention"]


class OutcomeRecorder:
    """pytest plugin: one record per test (its worst phase wins: a setup error or a call failure)."""

    def __init__(self) -> None:
        self.params: dict[str, dict[str, str]] = {}
        self.records: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            callspec = getattr(item, "callspec", None)
            params = {k: _param_name(v) for k, v in (callspec.params.items() if callspec else [])}
            self.params[item.nodeid] = {"test": getattr(item, "originalname", item.name), **params}

    def pytest_runtest_logreport(self, report) -> None:
        info = self.params.get(report.nodeid) or _params_from_nodeid(report.nodeid)
        record = self.records.setdefault(
            report.nodeid,
            {"nodeid": report.nodeid, "test": info["test"], "dtype": info.get("dtype", "-"),
             "params": {k: v for k, v in info.items() if k != "test"}, "outcome": "passed", "duration_s": 0.0},
        )
        record["duration_s"] = round(record["duration_s"] + report.duration, 3)
        if report.when == "call" and getattr(report, "wasxfail", None) is not None:
            record["outcome"] = "xpassed" if report.passed else "xfailed"
        elif report.skipped:
            record["outcome"] = "skipped"
            record["message"] = _skip_reason(report)
        elif report.failed:
            record["outcome"] = "failed" if report.when == "call" else "error"
            record["message"] = _short(report.longreprtext)


def _params_from_nodeid(nodeid: str) -> dict[str, str]:
    """Test name and dtype from a node id, for runs (pytest-xdist) where the controller collects nothing."""
    name, _, ids = nodeid.split("::")[-1].partition("[")
    tokens = ids.rstrip("]").split("-")
    dtypes = [t for t in tokens if t in ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")]
    return {"test": name, **({"dtype": dtypes[0]} if dtypes else {})}


def _param_name(value: Any) -> str:
    text = str(value)
    return text.removeprefix("torch.") if text.startswith("torch.") else getattr(value, "id", text)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else _short(str(longrepr))


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def print_table(records: list[dict[str, Any]]) -> None:
    groups: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in records:
        groups[(r["test"], r["dtype"])][r["outcome"]] += 1
    outcomes = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]
    shown = [o for o in outcomes if any(c[o] for c in groups.values())]
    width = max([len(t) for t, _ in groups] + [4])
    print(f"\n{'test':<{width}}  {'dtype':<9}" + "".join(f"{o:>9}" for o in shown))
    for (test, dtype), counts in sorted(groups.items()):
        flag = "  <-- FAILED" if counts["failed"] or counts["error"] else ""
        print(f"{test:<{width}}  {dtype:<9}" + "".join(f"{counts[o]:>9}" for o in shown) + flag)
    for r in records:
        if r["outcome"] in ("failed", "error"):
            print(f"\n---- {r['outcome'].upper()}: {r['nodeid']}\n{r.get('message', '')}")


def environment() -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version: Optional[str] = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    today = dt.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "h100" / f"{today}-gpu-tests.json",
                        help="where to write the JSON record (default: results/h100/<date>-gpu-tests.json)")
    parser.add_argument("--autotune", action="store_true", help="autotune the flash kernels (slow: many compiles)")
    parser.add_argument("pytest_args", nargs="*",
                        help=f"after `--`: pytest arguments, test paths included (default paths {DEFAULT_TESTS})")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU is visible (torch.cuda.is_available() is False); "
              "run this on the GPU machine. On the CPU, run `pytest tests/attention` instead.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes"):
        print("gpu_suite: TRITON_INTERPRET is set, so the kernels would run on the CPU; unset it.", file=sys.stderr)
        return 2
    os.environ["FLASH_ATTN_AUTOTUNE"] = "1" if args.autotune else "0"

    import pytest

    pytest_args = list(args.pytest_args)
    if not any(Path(REPO_ROOT, a.split("::")[0]).exists() for a in pytest_args if not a.startswith("-")):
        pytest_args += DEFAULT_TESTS
    recorder = OutcomeRecorder()
    os.chdir(REPO_ROOT)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    start = time.time()
    status = pytest.main(["-q", "-rN", "-p", "no:cacheprovider", *pytest_args], plugins=[recorder])
    wall_s = time.time() - start

    records = sorted(recorder.records.values(), key=lambda r: r["nodeid"])
    print_table(records)
    counts = Counter(r["outcome"] for r in records)
    summary = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        **environment(),
        "autotune": args.autotune,
        "pytest_args": pytest_args,
        "exit_status": int(status),
        "wall_s": round(wall_s, 1),
        "counts": dict(counts),
        "tests": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{dict(counts)} in {wall_s:.0f} s on {summary['gpu']}; wrote {args.out}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
