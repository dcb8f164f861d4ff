import pytest
import torch

from benchmarking import oom
from benchmarking.oom import (INJECT_OOM_ENV, InjectedOOM, call_catching_oom, catch_oom, is_oom,
                              maybe_inject_oom, short_message)


@pytest.mark.parametrize("exc,expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("out of memory"), False),  # only allocator error types count
])
def test_is_oom(exc, expected):
    assert is_oom(exc) is expected


def test_call_catching_oom_returns_value_or_oom(monkeypatch):
    freed = []
    monkeypatch.setattr(oom, "free_memory", lambda: freed.append(True))
    assert call_catching_oom(lambda: 42).value == 42
    assert freed == []

    def run_out():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nlong details")

    outcome = call_catching_oom(run_out, label="naive seq=16384")
    assert outcome.oom and outcome.status == "OOM" and outcome.value is None
    assert outcome.message == "CUDA out of memory. Tried to allocate 8.00 GiB"
    assert freed == [True]


def test_call_catching_oom_reraises_other_errors():
    with pytest.raises(ZeroDivisionError):
        call_catching_oom(lambda: 1 / 0)


def test_injection_by_environment_matches_substrings_only(monkeypatch):
    monkeypatch.setenv(INJECT_OOM_ENV, "flash b1 h1 seq=32, sdpa")
    ran = []
    assert call_catching_oom(lambda: ran.append("naive"), label="naive b1 h1 seq=32").oom is False
    hit = call_catching_oom(lambda: ran.append("flash"), label="flash b1 h1 seq=32 d=16")
    assert hit.oom and "injected" in hit.message
    assert call_catching_oom(lambda: ran.append("sdpa"), label="sdpa b1 h1 seq=16").oom
    assert ran == ["naive"]  # injected calls never run


def test_injection_by_argument_overrides_environment(monkeypatch):
    monkeypatch.setenv(INJECT_OOM_ENV, "naive")
    maybe_inject_oom("naive seq=16", inject="")  # explicit empty: nothing injected
    with pytest.raises(InjectedOOM):
        maybe_inject_oom("flex seq=16", inject="flex")
    assert issubclass(InjectedOOM, torch.OutOfMemoryError)


def test_catch_oom_context_manager():
    with catch_oom("naive seq=64", inject="seq=64") as guard:
        guard.maybe_inject()
        pytest.fail("the injected OOM must end the block")
    assert guard.oom and "naive seq=64" in guard.message
    with catch_oom("x") as clean:
        value = 1
    assert value == 1 and not clean.oom
    with pytest.raises(KeyError):
        with catch_oom("x"):
            raise KeyError("not an OOM")


def test_short_message_truncates():
    assert short_message(RuntimeError("a" * 500), limit=20) == "a" * 17 + "..."
    assert short_message(RuntimeError("")) == "RuntimeError"
