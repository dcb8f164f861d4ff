"""Optimizers by name (registry.py), the overlapped stepping during the backward, and the learning-rate schedule."""

from training.optim.registry import OptimizerSettings, OptimizerSpec, get_optimizer, optimizer_names, register

# Importing an optimizer's module registers it; the order is the order optimizer_names() lists.
from training.optim import adamw, adamw_bf16, muon  # noqa: E402,F401  isort: skip

__all__ = ["OptimizerSettings", "OptimizerSpec", "get_optimizer", "optimizer_names", "register"]
