"""profiling.torch_profile: trace and kernel table from a real CPU run, and the CUDA table from stand-in events."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from profiling.torch_profile import GpuTimeSplit, KernelRow, gpu_time_split, kernel_markdown, kernel_table, profile_steps


@pytest.mark.parametrize("active", [1, 3])
def test_cpu_profile_writes_trace_and_op_table(tmp_path, active):
    g = torch.Generator().manual_seed(active)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 80, generator=g)

    def step():
        return torch.softmax(a @ b, dim=-1).sum()

    result = profile_steps(step, tmp_path / "prof", "cpu", wait=1, warmup=1, active=active)
    trace = json.loads(result.trace_path.read_text())
    assert trace["traceEvents"]
    names = [r.name for r in result.rows]
    assert "aten::mm" in names and "aten::_softmax" in names
    assert not any(n.startswith("ProfilerStep#") for n in names)
    mm = next(r for r in result.rows if r.name == "aten::mm")
    assert mm.calls == active  # only the active steps are recorded
    assert sum(r.percent for r in result.rows) == pytest.approx(100.0, abs=0.1)
    assert [r.total_ms for r in result.rows] == sorted((r.total_ms for r in result.rows), reverse=True)
    table = result.table_path.read_text()
    assert "CPU ops by self CPU time" in table and "| `aten::mm` |" in table


def _event(key, us, device_type=DeviceType.CUDA, count=1, user=False):
    return SimpleNamespace(key=key, count=count, device_type=device_type, is_user_annotation=user,
                           self_device_time_total=us, self_cpu_time_total=us)


def test_gpu_table_keeps_kernels_only_and_shares_gpu_time():
    events = [
        _event("ampere_sgemm_128x64_tn", 600.0, count=12),
        _event("softmax_warp_forward", 300.0, count=4),
        _event("ProfilerStep#3", 900.0, user=True),  # a GPU-side user range would double count
        _event("forward", 900.0, user=True),
        _event("aten::mm", 5000.0, device_type=DeviceType.CPU),
        _event("Memset (Device)", 100.0),
        _event("idle", 0.0),
    ]
    rows = kernel_table(events, on_gpu=True)
    assert rows == [
        KernelRow("ampere_sgemm_128x64_tn", 12, 0.6, 60.0),
        KernelRow("softmax_warp_forward", 4, 0.3, 30.0),
        KernelRow("Memset (Device)", 1, 0.1, 10.0),
    ]
    text = kernel_markdown(rows, on_gpu=True, active_steps=2)
    assert "GPU kernels by total GPU time" in text and "% of GPU time" in text
    assert "(1.00 ms in all, 0.50 ms per step)" in text
    assert "| `ampere_sgemm_128x64_tn` | 12 | 0.600 | 60.0 |" in text


def test_markdown_shortens_long_names_and_escapes_pipes():
    rows = [KernelRow("k" * 200, 1, 1.0, 50.0), KernelRow("a|b", 2, 1.0, 50.0)]
    text = kernel_markdown(rows, on_gpu=False, active_steps=1, top=2, title="x")
    assert text.startswith("## x")
    assert "k" * 200 not in text and "..." in text
    assert "a\\|b" in text
    split = GpuTimeSplit(10.0, 8.0, 3.0, 1.0, 1.0)
    assert kernel_markdown(rows, True, 1, split=split).endswith(f"\n\n{split}.\n")


def test_bad_schedule_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="active >= 1"):
        profile_steps(lambda: None, tmp_path, "cpu", active=0)


def _gpu(name, start_us, dur_us, cat="kernel"):
    return {"cat": cat, "name": name, "ts": start_us, "dur": dur_us, "ph": "X"}


def test_the_gpu_time_splits_into_computing_communicating_alone_and_idle():
    # Two steps: compute 0-20 (two kernels overlapping), NCCL 15-40 (5 us beside compute, 20 alone of which a copy
    # covers 30-35), idle 40-50, compute 50-60. A CPU operator in the middle counts for nothing.
    events = [_gpu("nvjet_sm90_gemm", 0, 10), _gpu("triton_poi_fused_add_0", 8, 12),
              _gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 15, 25), _gpu("Memcpy DtoD", 30, 5, "gpu_memcpy"),
              {"cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 10, "ph": "X"}, _gpu("nvjet_sm90_gemm", 50, 10)]
    split = gpu_time_split(events, steps=2)
    assert split == GpuTimeSplit(span_ms=60 / 2e3, computing_ms=35 / 2e3, communicating_ms=25 / 2e3,
                                 exposed_ms=15 / 2e3, idle_ms=10 / 2e3)
    assert str(split).startswith("GPU time per step 0.03 ms: computing 0.02, communicating 0.01")


def test_a_trace_without_gpu_work_has_no_split():
    assert gpu_time_split([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}], steps=1) is None
