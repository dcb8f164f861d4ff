"""The compute precisions of train.py and bench_model.py: one name -> dtype table and the autocast that goes with it.

Every precision keeps fp32 master weights and optimizer state: bf16 and fp16 run the forward and backward under
autocast, fp16 adds a gradient scaler (CUDA only), fp32 computes in fp32.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context the forward runs in: autocast to the precision's dtype, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16's loss scaler; a disabled scaler (every call a no-op) for the other precisions."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
