"""profiling.memory_snapshot: refuses CPU clearly; on CUDA dumps a snapshot pickle."""

import pickle

import pytest
import torch

from profiling.memory_snapshot import record_memory_history, snapshot_unavailable


def test_cpu_is_refused_with_a_clear_message():
    reason = snapshot_unavailable("cpu")
    assert reason.startswith("--memory-snapshot needs a CUDA device")
    assert "'cpu'" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_recording_without_cuda_raises(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with record_memory_history(tmp_path / "snap.pickle"):
            pass
    assert not (tmp_path / "snap.pickle").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_records_allocations_on_cuda(tmp_path):
    path = tmp_path / "snap.pickle"
    with record_memory_history(path, max_entries=1000):
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        del x, y
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
