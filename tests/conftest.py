"""Shared test set-up: run Triton kernels in the interpreter when there is no GPU."""

import os

import torch

# Must happen before any module that defines Triton kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
