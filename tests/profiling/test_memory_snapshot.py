"""profiling.memory_snapshot: refuses CPU clearly; on CUDA dumps a snapshot pickle."""

import pickle

import pytest
import torch

from profiling.memory_snapshot import format_peak, main, peak_report, record_memory_history, snapshot_unavailable


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
    # At the peak x and y (4 MiB each) are live, both allocated on lines of this file.
    report = peak_report(snapshot, torch.cuda.current_device())
    ours = [g for g in report.groups if "test_memory_snapshot.py" in g.where and g.size == 4 * 2**20]
    assert sum(g.count for g in ours) == 2


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


MODEL = _frame("/repo/model/transformer.py", 30, "forward")
GENERATED = _frame("/tmp/torchinductor_me/ab/cabc.py", 120, "call")
TORCH = _frame("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1775, "_call_impl")


def _snapshot(trace, live_at_end):
    """A snapshot dict as torch.cuda.memory._snapshot() shapes it: segments with blocks, one device trace."""
    blocks = [{"size": size, "state": "active_allocated"} for size in live_at_end]
    blocks.append({"size": 4096, "state": "inactive"})  # cached, not allocated: must not count
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr, size):
    return [{"action": "free_requested", "addr": addr, "size": size, "frames": []},
            {"action": "free_completed", "addr": addr, "size": size, "frames": []}]


def test_peak_report_finds_the_peak_and_what_is_live_there():
    mib = 2**20
    trace = [
        _alloc(1, 8 * mib, GENERATED, TORCH, MODEL),  # activation, compiled code
        _alloc(2, 8 * mib, GENERATED, TORCH, MODEL),
        *_free(100, 16 * mib),  # a block from before the window (e.g. last step's gradient) is freed
        _alloc(3, 32 * mib, MODEL),  # the peak: 64 (before) - 16 + 8 + 8 + 32 = 96 MiB
        *_free(3, 32 * mib),
        *_free(1, 8 * mib),
        _alloc(4, 2 * mib, TORCH, MODEL),
    ]
    # At the end: the 48 MiB from before that were not freed, block 2 and block 4.
    report = peak_report(_snapshot(trace, [48 * mib, 8 * mib, 2 * mib]))
    assert report.peak_bytes == 96 * mib
    assert report.before_bytes == 48 * mib
    assert report.events == 4
    assert [(g.where, g.size, g.count) for g in report.groups] == [
        ("transformer.py:30 forward", 32 * mib, 1),
        ("cabc.py:120 call <- transformer.py:30 forward", 8 * mib, 2),
    ]
    text = format_peak(report, top=1)
    assert "96.0 MiB" in text and "48.0 MiB  allocated before recording" in text
    assert "1 smaller groups" in text


def test_peak_report_cli_reads_a_pickle_and_names_a_missing_file(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot([_alloc(1, 2**20, MODEL)], [2**20])))
    main([str(path), "--top", "5"])
    out = capsys.readouterr().out
    assert "peak allocated in the window: 1.0 MiB" in out and "transformer.py:30 forward" in out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.pickle")])
    assert "no snapshot file at" in capsys.readouterr().err


def test_a_snapshot_that_names_a_class_is_refused_without_running_it(tmp_path):
    import pickle

    from profiling.memory_snapshot import load_snapshot

    marker = tmp_path / "ran"

    class Crafted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [Crafted()]}))
    with pytest.raises(pickle.UnpicklingError, match="may not refer to"):
        load_snapshot(path)
    assert not marker.exists()
    plain = {"segments": [{"blocks": [], "device": 0}], "device_traces": [[]]}
    path.write_bytes(pickle.dumps(plain))
    assert load_snapshot(path) == plain
