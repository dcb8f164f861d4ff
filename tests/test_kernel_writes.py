"""torch.compile sees each traced Triton kernel write its outputs and nothing else (tests/kernel_writes.py): an input
it took for written would be copied on every call, as the SwiGLU projection once was (135 us a layer of `small`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every test reads the analysis of a fresh Python that compiles the kernels for sm_90.
pytestmark = pytest.mark.slow

OUTPUTS = {
    "silu_mul": ["out_ptr"],
    "silu_mul_backward": ["grad_gate_up_ptr"],
    "split_rotate": ["k_ptr", "q_ptr", "v_ptr"],
    "merge_rotate_back": ["dqkv_ptr"],
    "attn_fwd": ["L", "O"],
    "attn_bwd_dq": ["DELTA", "DQ"],
    "attn_bwd_dkdv": ["DK", "DV"],
}


@pytest.fixture(scope="module")
def writes() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernel_writes"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", sorted(OUTPUTS))
def test_kernel_writes_only_its_outputs(writes, kernel):
    assert writes[kernel] == OUTPUTS[kernel]


def test_every_traced_kernel_is_checked(writes):
    assert sorted(writes) == sorted(OUTPUTS)
