"""Benchmark tests run on CPU: Triton kernels go through the interpreter, which must be chosen before import."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")
