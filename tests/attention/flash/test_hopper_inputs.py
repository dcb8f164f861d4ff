"""Which inputs the Hopper kernels take (attention/flash/hopper/inputs.py), and the reason for those they do not."""

from __future__ import annotations

import pytest
import torch

from attention.flash.hopper import inputs as hopper_inputs

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0) and hopper_inputs.gluon_problem() is None
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton's Gluon")
DEVICE = torch.device("cuda" if CUDA else "cpu")


def randn(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def test_forward_problem_names_the_reason():
    q = randn(1, 2, 128, 64, device="cpu")
    assert hopper_inputs.forward_problem(q, q, q, True) == "the Hopper kernels need CUDA tensors"
    assert hopper_inputs.backward_problem(q, q, q, q, True) == "the Hopper kernels need CUDA tensors"
    assert "got dO torch.float16 and q torch.float32" in hopper_inputs.backward_problem(q, q, q, q.half(), True)


@requires_hopper
@pytest.mark.parametrize("q_shape, k_len, dtype, message", [
    ((1, 2, 128, 80), 128, torch.bfloat16, "head dims"),
    ((1, 2, 128, 64), 128, torch.float32, "float16 and bfloat16"),
    ((1, 2, 200, 64), 200, torch.bfloat16, "multiple of 128"),
    ((1, 2, 128, 64), 256, torch.bfloat16, "as many keys as queries"),
], ids=["d80", "fp32", "n200", "n_k"])
def test_forward_problem_on_the_gpu(hopper_at_every_size, monkeypatch, q_shape, k_len, dtype, message):
    b, h, n, d = q_shape
    q = randn(b, h, n, d, dtype=dtype)
    k = randn(b, h, k_len, d, dtype=dtype)
    assert message in hopper_inputs.forward_problem(q, k, k, False)
    assert message in hopper_inputs.backward_problem(q, k, k, q, False)
    ok = randn(1, 2, 256, 64, dtype=torch.bfloat16)
    assert hopper_inputs.forward_problem(ok, ok, ok, True) is None
    assert hopper_inputs.backward_problem(ok, ok, ok, ok, True) is None
    assert "need dO in (batch, heads, seq, d)" in hopper_inputs.backward_problem(ok, ok, ok, ok.transpose(-2, -1), True)
    monkeypatch.setattr(hopper_inputs, "MIN_SCORES", {"forward": {64: 2**16 + 1}, "backward": {64: 2**16}})
    assert "2^16 scores are too few" in hopper_inputs.forward_problem(ok, ok, ok, True)  # 2 * 256^2 / 2 when causal
    assert hopper_inputs.forward_problem(ok, ok, ok, False) is None
    assert hopper_inputs.backward_problem(ok, ok, ok, ok, True) is None
    # Replayed from a CUDA graph, host time does not count: the backward takes any size, the d-64 forward from
    # REPLAYED_MIN_SCORES.
    assert hopper_inputs.backward_problem(ok, ok, ok, ok, True, replayed=True) is None
    assert "less GPU time" in hopper_inputs.forward_problem(ok, ok, ok, True, replayed=True)


def test_min_scores_depend_on_pass_head_dim_and_replay():
    # Eager, a launch's host time lets each pass's Hopper kernels run only from its own size on (B1 H16 N4096 causal
    # is 2^27 scores); replayed from a CUDA graph, GPU time alone decides.
    def bounds(d, replayed):
        return [hopper_inputs.min_scores(d, pass_name, replayed) for pass_name in ("forward", "backward")]

    assert bounds(64, False) == [2**28, 2**27] and bounds(128, False) == [2**26, 2**26]
    assert bounds(64, True) == [2**27, 0] and bounds(128, True) == [0, 0]


def test_a_table_of_one_bound_per_pass_covers_every_head_dim(monkeypatch):
    monkeypatch.setattr(hopper_inputs, "MIN_SCORES", hopper_inputs.min_scores_at_every_head_dim(5, 7))
    for d in hopper_inputs.HEAD_DIMS:
        assert [hopper_inputs.min_scores(d, p, replayed=False) for p in ("forward", "backward")] == [5, 7]


def test_a_window_counts_the_scores_of_the_tiles_it_visits():
    assert hopper_inputs.scores(2, 1024, True) == 2 * 1024 * 1024 // 2
    assert hopper_inputs.scores(2, 1024, True, window=100) == 2 * 1024 * (100 + 128)  # its band and a tile
    assert hopper_inputs.scores(2, 1024, False, window=100) == 2 * 1024 * (200 + 128)
    no_window = hopper_inputs.scores(2, 1024, True)
    assert hopper_inputs.scores(2, 1024, True, window=4096) == no_window  # no more than without


@pytest.mark.parametrize("shape, kv_heads, sms, why", [
    ((8, 32, 512, 128), 32, 132, "below 2048 keys at d 128"),
    ((4, 16, 2048, 128), 16, 132, None),  # 1024 dK/dV programs
    ((1, 8, 8192, 128), 8, 132, "512 dK/dV programs, under 4 waves of 132 SMs"),
    ((1, 8, 8192, 128), 8, 114, None),  # the same on a GPU that 512 programs fill four times
    ((1, 64, 2048, 128), 8, 132, "128 dK/dV programs"),  # GQA below 4096 keys: a program per key/value head
    ((1, 64, 4096, 128), 8, 132, None),  # groups of 8 from 4096 keys: a program per query head, 2048 of them
    ((1, 32, 8192, 64), 8, 132, "512 dK/dV programs"),  # groups of 4 too
    ((1, 64, 8192, 128), 8, 132, None),
    ((1, 4, 16384, 128), 4, 132, None),  # 512 programs: from 16384 keys three waves suffice
    ((1, 2, 16384, 128), 2, 132, "256 dK/dV programs, under 3 waves of 132 SMs"),
    ((8, 32, 512, 64), 32, 132, None),  # d 64 has no bound on the sequence
    ((1, 16, 8192, 128), 16, 132, None),
    ((1, 1, 128, 64), 1, 132, "1 dK/dV program,"),
], ids=str)
def test_the_fused_backward_runs_where_its_programs_fill_the_gpu(shape, kv_heads, sms, why):
    """The two kernels side by side run dQ's programs beside dK/dV's: they run where the fused backward's dK/dV
    programs (one per 128 keys of a key/value head) are under four waves of SMs (three from 16384 keys), and at d 128
    below 2048 keys."""
    b, h, n, d = shape
    problem = hopper_inputs.fused_backward_problem(b, h, kv_heads, n, d, sms)
    assert problem is None if why is None else why in problem, problem


def test_the_fused_backward_takes_no_window_or_documents():
    for kw in ({"window": 256}, {"docs": True}):
        assert hopper_inputs.fused_backward_problem(1, 16, 16, 8192, 64, 132, **kw) == (
            "the fused backward takes no window or documents")


@pytest.mark.parametrize("heads, kv_heads, n, fused, per_query_head", [
    (64, 8, 8192, True, True), (32, 2, 16384, True, True), (64, 8, 4096, True, True), (64, 8, 2048, True, False),
    (32, 8, 16384, True, False), (16, 16, 16384, True, False), (32, 2, 2048, True, False),
    (32, 2, 2048, False, True), (128, 8, 8192, False, True), (64, 8, 8192, False, False),
    (32, 2, 1024, False, False)])
def test_long_gqa_of_large_groups_runs_a_program_per_query_head(heads, kv_heads, n, fused, per_query_head):
    """Fused with groups of 8 query heads or more from 4096 keys, deterministic with groups of 16 or more from 2048
    (QUERY_HEAD_PROGRAMS_MIN), the backward's dK/dV programs take a query head each; the fused ones then count
    heads, not key/value heads."""
    assert hopper_inputs.query_head_programs(heads, kv_heads, n, fused) == per_query_head
    if fused:
        programs = hopper_inputs.fused_dkdv_programs(2, heads, kv_heads, n, 128, 132)
        assert programs == 2 * (heads if per_query_head else kv_heads) * n // 128
