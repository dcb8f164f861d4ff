import time

import pytest
import torch

from benchmarking.timing import (allocated_bytes, captured, peak_allocated_bytes, reset_peak_memory, summarize,
                                 tflops, time_ms, time_stats_ms, to_mib)


def test_summarize_known_values():
    stats = summarize([1.0, 2.0, 3.0, 10.0])
    assert stats.median_ms == 2.5
    assert stats.mean_ms == 4.0
    assert stats.min_ms == 1.0
    assert stats.n == 4
    assert stats.std_ms == pytest.approx(4.0824829, rel=1e-6)  # sample std
    assert summarize([5.0]).std_ms == 0.0
    assert stats.as_dict("step_") == {"step_median_ms": 2.5, "step_mean_ms": 4.0, "step_std_ms": stats.std_ms,
                                      "step_min_ms": 1.0, "step_n": 4}


def test_summarize_rejects_empty():
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


@pytest.mark.parametrize("timer", [time_ms, time_stats_ms])
def test_cpu_timer_measures_the_call_and_counts_calls(timer):
    calls = []

    def sleep_2ms():
        calls.append(1)
        time.sleep(0.002)

    stats = timer(sleep_2ms, "cpu", iters=5, warmup=2)
    assert stats.n == 5
    assert len(calls) == 7  # warm-up calls are made but not timed
    assert 2.0 <= stats.min_ms <= stats.median_ms < 50.0


@pytest.mark.parametrize("timer", [time_ms, time_stats_ms])
def test_grad_to_none_resets_before_every_call(timer):
    x = torch.randn(8, requires_grad=True)
    seen = []

    def step():
        seen.append(x.grad is None)
        (x * 2).sum().backward()

    timer(step, "cpu", iters=3, warmup=1, grad_to_none=[x])
    assert seen == [True] * 4


@pytest.mark.parametrize("iters,warmup", [(0, 1), (-1, 0), (1, -1)])
def test_bad_counts(iters, warmup):
    with pytest.raises(ValueError):
        time_ms(lambda: None, "cpu", iters=iters, warmup=warmup)


def test_tflops_and_mib():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(1e12, 0.5) == pytest.approx(2000.0)
    assert tflops(1e12, None) is None
    assert tflops(1e12, 0.0) is None
    assert to_mib(3 * 1024**2) == 3.0
    assert to_mib(None) is None


def test_memory_helpers_off_cuda_give_none():
    reset_peak_memory("cpu")
    assert allocated_bytes("cpu") is None
    assert peak_allocated_bytes("cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_timer_and_memory():
    a = torch.randn(2048, 2048, device="cuda")
    stats = time_ms(lambda: a @ a, "cuda", iters=20, warmup=5)
    assert 0 < stats.median_ms < 100 and 1 <= stats.n <= 40  # about iters=20; estimates are noisy
    reset_peak_memory("cuda")
    before = allocated_bytes("cuda")
    b = torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda")
    assert allocated_bytes("cuda") - before >= 64 * 1024**2
    assert peak_allocated_bytes("cuda") >= allocated_bytes("cuda")
    del b


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        captured(lambda: None, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_backward_replays_fresh_gradients():
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, 256, device="cuda")
    replay = captured(lambda: (x @ w).square().sum().backward(), "cuda", grad_to_none=[x])
    want = 2 * (x.detach() @ w) @ w.t()
    x.grad.fill_(float("nan"))
    with torch.no_grad():
        x.mul_(2)  # the replay reads x's memory as it is now
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(x.grad, 2 * want, rtol=1e-4, atol=1e-2)  # written, not accumulated into NaN
    stats = time_ms(replay, "cuda", iters=20, warmup=5)
    assert 0 < stats.median_ms < 100
