"""profiling.run_profiler: which steps `train.py --profile` records, and the files a window leaves."""

import json

import pytest
import torch

from profiling.run_profiler import SETTLE_STEPS, RunProfiler, profile_window


@pytest.mark.parametrize("first, warm, steps, count, window", [
    (0, 0, 100, 3, (SETTLE_STEPS, 3)),      # no warm-up: after the settling steps (the last warms the profiler up)
    (0, 4, 100, 3, (4 + SETTLE_STEPS, 3)),  # after the compile and the graph's capture, then the settling steps
    (0, 4, 6, 3, (3, 3)),                   # too short: the last steps
    (10, 1, 12, 3, (11, 1)),                # a resumed run with two steps left: one warms up, one is recorded
    (5, 0, 6, 3, (6, 0)),                   # one step left: none recorded
])
def test_the_window_follows_the_warm_up_or_ends_the_run(first, warm, steps, count, window):
    assert profile_window(first, warm, steps, count) == window


def _run(profiler: RunProfiler, steps: int, stop_after: int | None = None) -> list[str]:
    g = torch.Generator().manual_seed(steps)
    a, b = torch.randn(48, 64, generator=g), torch.randn(64, 32, generator=g)
    lines = []
    for step in range(steps if stop_after is None else stop_after):
        profiler.before_step(step)
        torch.softmax(a @ b, dim=-1).sum()
        line = profiler.after_step(step + 1)
        if line:
            lines.append(line)
    profiler.close()
    return lines


@pytest.mark.parametrize("rank", [0, 1])
def test_a_window_writes_each_ranks_trace_of_its_steps_and_kernel_table(tmp_path, rank):
    lines = _run(RunProfiler(tmp_path / "prof", 2, 3, torch.device("cpu"), rank), steps=7)
    trace, table = tmp_path / "prof" / f"trace-rank{rank}.json", tmp_path / "prof" / f"kernels-rank{rank}.md"
    assert lines == [f"profiled steps 3-5: {trace}, {table.name}"]
    events = json.loads(trace.read_text())["traceEvents"]
    # ProfilerStep#0 is the warm-up step before the window, which the trace leaves out with its operators.
    assert sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep#")) == [
        "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    assert sum(e["name"] == "aten::mm" for e in events) == 3
    text = table.read_text()
    assert f"steps 3-5, rank {rank}" in text and "| `aten::mm` | 3 |" in text
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [table.name, trace.name]  # no temporary left


def test_a_run_that_stops_inside_the_window_writes_nothing(tmp_path):
    assert _run(RunProfiler(tmp_path / "prof", 2, 3, torch.device("cpu"), 0), steps=7, stop_after=4) == []
    assert not (tmp_path / "prof").exists()
