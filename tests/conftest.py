"""Shared test set-up: run Triton kernels in the interpreter when there is no GPU, with a Triton cache of the run's own."""

import atexit
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch

# Must happen before any module that defines Triton kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_SILENT", "true")

# Each run gets a fresh Triton cache, inherited by the subprocesses it starts and removed at exit, so that two runs
# (a second pytest, a training run, a GPU run of the same tree) never read each other's compiled kernels.
_TRITON_CACHE = tempfile.mkdtemp(prefix="flash-lm-triton-cache-")
os.environ["TRITON_CACHE_DIR"] = _TRITON_CACHE
atexit.register(shutil.rmtree, _TRITON_CACHE, ignore_errors=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """About 200 KB of real Python source, for training runs on the CPU."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"\n".join((stdlib / name).read_bytes() for name in ("argparse.py", "textwrap.py")))
    return path
