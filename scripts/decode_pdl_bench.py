"""flash's decode step, whose combine kernel starts by programmatic dependent launch, against the step of another
commit, cuDNN and a copy, replayed from CUDA graphs, under do_bench's L2 flush (a write of 256 MB, which leaves L2 dirty) and under a
flush that reads 512 MB (L2 left clean, as in a model's decode step, whose earlier kernels write little).

    python scripts/decode_pdl_bench.py --against 4bf4eb4
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention import graph_replay  # noqa: E402
from attention.flash.decode import host  # noqa: E402
from benchmarking.timing import captured, time_ms  # noqa: E402

POINTS = [(1, 32, 8, 128, 2048), (1, 32, 8, 128, 16384), (1, 32, 8, 128, 65536), (1, 32, 32, 128, 16384),
          (1, 16, 16, 64, 16384), (4, 16, 16, 64, 16384), (4, 16, 16, 64, 65536), (4, 32, 8, 128, 16384)]


def other_host(rev: str):
    """attention/flash/decode/host.py and kernels.py of commit `rev` (or from the directory `rev`, for a copy of the
    tree without git), loaded as modules of their own."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp()
    for name in ("host", "kernels"):
        if os.path.isdir(rev):
            with open(os.path.join(rev, f"{name}.py")) as f:
                text = f.read()
        else:
            text = subprocess.run(["git", "show", f"{rev}:attention/flash/decode/{name}.py"], cwd=root, check=True,
                                  capture_output=True, text=True).stdout
        text = text.replace("from attention.flash.decode import kernels  #", "import other_decode_kernels as kernels  #")
        text = "\n".join(line for line in text.splitlines() if not line.startswith("register_decode("))
        with open(os.path.join(tmp, f"other_decode_{name}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, tmp)
    spec = importlib.util.spec_from_file_location("other_decode_host", os.path.join(tmp, "other_decode_host.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_flush_us(fn, flush: torch.Tensor, n: int = 100) -> float:
    """Median µs of fn between CUDA events, each call after a read of `flush`."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        flush.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the commit whose decode is compared (or a directory "
                                                    "holding its attention/flash/decode/host.py and kernels.py)")
    args = p.parse_args()
    other = other_host(args.against)
    dev = torch.device("cuda")
    flush = torch.ones(512 * 2**20 // 4, device=dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs replayed from a CUDA graph, bf16; copy: the "
          "cache's bytes read and written (eager); frac: K+V bytes / flash's (PDL) time against the copy's 2 x bytes / time")
    print("  B   H  KV    D  cache | do_bench:   before     PDL   cudnn    copy  frac | read flush:   before     PDL"
          "   cudnn    copy  frac")
    for batch, heads, kv_heads, d, cache in POINTS:
        g = torch.Generator(dev).manual_seed(0)
        q = torch.randn(batch, heads, 1, d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, kv_heads, cache, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        lens = torch.full((batch,), cache, device=dev)
        src = torch.empty((k.nbytes + v.nbytes) // 2, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        calls = {"before": lambda: other.decode_triton(q, k, v, lens, d ** -0.5),
                 "pdl": lambda: host.decode_triton(q, k, v, lens, d ** -0.5),
                 "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != heads)}
        assert torch.equal(calls["before"](), calls["pdl"]())  # the same kernels, launched otherwise
        runs = {}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), graph_replay():
            for name, fn in calls.items():
                runs[name] = captured(fn, dev)
        runs["copy"] = lambda: dst.copy_(src)
        cells = []
        for timer in (lambda fn: time_ms(fn, dev, iters=100, warmup=10).median_ms * 1e3,
                      lambda fn: clean_flush_us(fn, flush)):
            us = {name: timer(fn) for name, fn in runs.items()}
            frac = (src.nbytes / us["pdl"]) / (2 * src.nbytes / us["copy"])
            cells.append(" ".join(f"{us[n]:7.1f}" for n in ("before", "pdl", "cudnn", "copy")) + f" {frac:5.0%}")
        print(f"{batch:3d} {heads:3d} {kv_heads:3d} {d:4d} {cache:6d} |          {cells[0]} |            {cells[1]}",
              flush=True)


if __name__ == "__main__":
    main()
