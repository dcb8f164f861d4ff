"""GPU time per training step by kernel category (matmuls, attention, AdamW, elementwise, ...) from a profiler trace.

    python scripts/kernel_categories.py RUN/prof/trace.json 2 --top 45

TRACE is a Chrome trace that `bench_model.py --profile DIR` writes (DIR/trace.json, or one folder per configuration
under DIR) or `train.py --profile DIR` (DIR/trace-rank<r>.json); STEPS is how many steps it recorded
(`--profile-steps`). Prints ms per step per category, the kernels that took the most GPU time, then how the GPU's time
split between computing, communicating and idling. `scripts/gpu.sh profile` runs it on the training-step configs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from profiling.torch_profile import COMMUNICATION, GPU_WORK, gpu_time_split  # noqa: E402

# First match wins. cuBLAS names its Hopper GEMMs nvjet_*/sm90_xmma_*, and Inductor's own kernels start with triton_.
CATEGORIES = [
    ("communication (NCCL)", COMMUNICATION),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|Kernel2", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|cudnn|attn", re.I)),
    ("adamw", re.compile(r"multi_tensor_apply|adam", re.I)),  # torch's fused AdamW; training/optim/adamw_bf16_kernel.py
    ("memset/copy", re.compile(r"Memset|Memcpy", re.I)),
    ("rope (model.fused_rope)", re.compile(r"^(split_rotate|merge_rotate_back)$")),
    ("elementwise (inductor)", re.compile(r"^triton_")),
    ("other", re.compile(r".")),
]


def category(kernel_name: str) -> str:
    """The category of one kernel name (the first pattern of CATEGORIES that matches)."""
    return next(name for name, pattern in CATEGORIES if pattern.search(kernel_name))


def kernel_times(events: list[dict]) -> dict[str, list[float]]:
    """Each GPU kernel's (and memset's/memcpy's) durations in ms, by name, from a torch.profiler Chrome trace's events."""
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for event in events:
        if event.get("cat") in GPU_WORK and "dur" in event:
            per_kernel[event["name"]].append(event["dur"] / 1e3)
    return dict(per_kernel)


def report(per_kernel: dict[str, list[float]], steps: int, top: int = 40) -> str:
    """ms per step per category (largest first), then the `top` kernels by total time."""
    per_category: dict[str, float] = collections.defaultdict(float)
    for name, durations in per_kernel.items():
        per_category[category(name)] += sum(durations)
    total = sum(per_category.values())
    lines = [f"GPU time per step: {total / steps:.2f} ms over {steps} steps"]
    for name, ms in sorted(per_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:24s} {ms / steps:8.2f} ms  {100 * ms / total:5.1f}%")
    lines.append(f"{'calls/step':>10s} {'ms/step':>8s} {'us/call':>8s}  kernel")
    for name, durations in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{len(durations) / steps:10.1f} {sum(durations) / steps:8.3f} "
                     f"{1e3 * sum(durations) / len(durations):8.1f}  {name[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="torch.profiler Chrome trace (bench_model.py --profile DIR/trace.json)")
    parser.add_argument("steps", type=int, help="profiled steps in the trace (bench_model.py --profile-steps)")
    parser.add_argument("--top", type=int, default=40, help="kernels listed after the categories (default 40)")
    args = parser.parse_args(argv)
    events = json.loads(args.trace.read_text())["traceEvents"]
    print(report(kernel_times(events), args.steps, args.top))
    split = gpu_time_split(events, args.steps)
    if split:
        print(split)


if __name__ == "__main__":
    main()
