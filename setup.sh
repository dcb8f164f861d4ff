#!/usr/bin/env bash
# Creates ./.venv and installs the project with its test tools. Safe to run again. Prints one line on success; on a
# failure, the failing command's output.
# With an NVIDIA GPU (nvidia-smi present), pip takes the CUDA build of torch from the registry; without one, torch
# 2.13.0, which on the CPU machines of this project is a small CPU build.
set -euo pipefail
cd "$(dirname "$0")"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; echo "setup.sh: failed: $*" >&2; exit 1; }; }
quiet python3 -m venv .venv
quiet .venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
    quiet .venv/bin/python -m pip install -q "torch==2.13.0"
fi
quiet .venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, triton; print(f'setup.sh: .venv ready: torch {torch.__version__}, triton {triton.__version__}, CUDA: {torch.cuda.is_available()}')"
