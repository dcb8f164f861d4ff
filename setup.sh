#!/usr/bin/env bash
# Creates ./.venv and installs the project with its test tools. Safe to run again.
# With an NVIDIA GPU (nvidia-smi present), pip takes the CUDA build of torch from the registry;
# without one, it takes torch 2.13.0, which on the CPU machines of this project is a small CPU build.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, CUDA: {torch.cuda.is_available()}')"
