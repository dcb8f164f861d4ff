"""What a benchmark ran on: GPU, library versions, host, date, git commit; stored next to every result."""

from __future__ import annotations

import datetime
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit(repo_dir: Path | str = REPO_ROOT) -> Optional[str]:
    """The checked-out commit (with '-dirty' if the tree has changes), or None outside git / without commits."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo_dir, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def environment_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Flat dict of the run's environment; `device` defaults to CUDA when present, else CPU.

    Keys: device, gpu_name, gpu_count, gpu_memory_gib, cuda, cudnn, torch, triton, python, platform,
    cpu, hostname, date (ISO, local time with offset), git_commit. Values absent here are None.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    gpu_name = gpu_memory_gib = None
    if on_cuda:
        props = torch.cuda.get_device_properties(device)
        gpu_name = props.name
        gpu_memory_gib = round(props.total_memory / 1024**3, 2)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "device": str(device),
        "gpu_name": gpu_name,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu_memory_gib": gpu_memory_gib,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }


def describe(info: dict[str, Any]) -> str:
    """One line for logs: 'NVIDIA H100 | torch 2.11 | triton 3.6 | CUDA 12.8 | cuDNN 91000 | <commit>'."""
    parts = [info.get("gpu_name") or f"CPU ({info.get('cpu')})", f"torch {info.get('torch')}"]
    for key, label in (("triton", "triton"), ("cuda", "CUDA"), ("cudnn", "cuDNN")):
        if info.get(key):
            parts.append(f"{label} {info[key]}")
    if info.get("git_commit"):
        sha, _, dirty = str(info["git_commit"]).partition("-")
        parts.append(f"git {sha[:12]}{'-' + dirty if dirty else ''}")  # a tree with changes says so
    return " | ".join(parts)
