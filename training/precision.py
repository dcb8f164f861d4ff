"""The autocast and the gradient scaler that go with a compute precision (training.config.DTYPES names them), and
--deterministic's switch.

Every precision keeps fp32 master weights: bf16 and fp16 run the forward and backward under autocast, fp16 adds a
gradient scaler (CUDA only), fp32 computes in fp32.
"""

from __future__ import annotations

import contextlib
import os

import torch

from training.config import DTYPES


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context the forward runs in: autocast to the precision's dtype, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16's loss scaler; a disabled scaler (every call a no-op) for the other precisions."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def use_deterministic_algorithms(on: bool) -> None:
    """--deterministic: torch.use_deterministic_algorithms(True), with the cuBLAS workspace that deterministic matmuls
    need (read when cuBLAS first runs: before the model is built). Off, the process's setting stays as it is."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
