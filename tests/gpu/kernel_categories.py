"""Every GPU kernel of a torch.profiler Chrome trace, grouped into categories (GEMM, AdamW, attention, ...).

Usage: python tests/gpu/kernel_categories.py TRACE.json STEPS [--top N]
Prints ms per step per category, then the top kernels; used to plan the training-step work (results/README.md).
"""

from __future__ import annotations

import collections
import json
import re
import sys

CATEGORIES = [  # first match wins
    ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|Kernel2", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|cudnn|attn", re.I)),
    ("adamw", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("memset/copy", re.compile(r"Memset|Memcpy", re.I)),
    ("elementwise (inductor)", re.compile(r"^triton_")),
    ("other", re.compile(r".")),
]


def main(argv: list[str]) -> None:
    path, steps = argv[0], int(argv[1])
    top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 40
    events = json.load(open(path))["traceEvents"]
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e:
            per_kernel[e["name"]].append(e["dur"] / 1e3)
    per_cat: dict[str, float] = collections.defaultdict(float)
    for name, durs in per_kernel.items():
        cat = next(c for c, rx in CATEGORIES if rx.search(name))
        per_cat[cat] += sum(durs)
    total = sum(per_cat.values())
    print(f"GPU time per step: {total / steps:.2f} ms over {steps} steps")
    for cat, ms in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:24s} {ms / steps:8.2f} ms  {100 * ms / total:5.1f}%")
    print(f"{'calls/step':>10s} {'ms/step':>8s} {'us/call':>8s}  kernel")
    for name, durs in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{len(durs) / steps:10.1f} {sum(durs) / steps:8.3f} {1e3 * sum(durs) / len(durs):8.1f}  {name[:110]}")


if __name__ == "__main__":
    main(sys.argv[1:])
