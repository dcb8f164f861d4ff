"""What train.py runs when --dtype, --compile and --cuda-graph are left out: the fast path wherever it applies.

On CUDA the default is bf16 autocast, regional torch.compile and the whole step replayed as one CUDA graph, each
where the configuration allows it; on the CPU, fp32 and eager. A flag given on the command line always wins
(`--no-compile`, `--no-cuda-graph`, `--dtype fp32`). `choose` returns the choice and one line that says it and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SpeedChoice:
    dtype: str
    compile: bool
    cuda_graph: bool
    line: str  # e.g. "speed: bf16; compiled; CUDA graph; --no-compile and --no-cuda-graph to opt out"


def _graph_obstacle(device: torch.device, parallel: str, dtype: str, activation_checkpointing: bool) -> Optional[str]:
    """Why the step is not captured as a CUDA graph by default, or None."""
    if device.type != "cuda":
        return "needs CUDA"
    if parallel != "none":
        return f"--parallel {parallel}"
    if dtype == "fp16":
        return "--dtype fp16, whose gradient scaler checks for inf on the host"
    if activation_checkpointing:
        return "--activation-checkpointing"
    return None


def choose(device: torch.device, *, dtype: Optional[str], compile: Optional[bool], cuda_graph: Optional[bool],
           parallel: str = "none", activation_checkpointing: bool = False) -> SpeedChoice:
    """The step's precision, compilation and CUDA graph: the given values, and for each None the fast default."""
    cuda = device.type == "cuda"
    if dtype is None:
        dtype = "bf16" if cuda else "fp32"
    compile_text = None
    if compile is None:
        compile = cuda and torch._dynamo.is_dynamo_supported()
        if not compile:
            compile_text = "eager: " + ("on the CPU (--compile compiles)" if not cuda
                                        else "torch.compile is not supported here")
    graph_text = None
    if cuda_graph is None:
        obstacle = _graph_obstacle(device, parallel, dtype, activation_checkpointing)
        cuda_graph = obstacle is None
        if obstacle:
            graph_text = f"no CUDA graph: {obstacle}"
    parts = [dtype, compile_text or ("compiled" if compile else "eager"),
             graph_text or ("CUDA graph" if cuda_graph else "no CUDA graph")]
    opt_out = [flag for flag, on in (("--no-compile", compile), ("--no-cuda-graph", cuda_graph)) if on]
    line = "speed: " + "; ".join(parts + ([f"{' and '.join(opt_out)} to opt out"] if opt_out else []))
    return SpeedChoice(dtype, compile, cuda_graph, line)
