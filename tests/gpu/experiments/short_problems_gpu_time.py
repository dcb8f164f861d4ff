"""Experiment: below flash_hopper.MIN_SCORES, are the Hopper kernels faster than flash's Triton kernels once host
time is out of the picture (a CUDA graph replays the launches)?

MIN_SCORES keeps problems under 2^28 scores on the Triton kernels because the Gluon launches cost more host time.
Inside a captured CUDA graph that cost is paid once, at capture. For each shape (causal, bf16, (batch, heads, seq,
d) storage): forward and forward+backward of flash on its Triton kernels, flash forced onto the Hopper kernels
(MIN_SCORES = 0) and SDPA's cuDNN kernel, each captured once in a CUDA graph and its replay timed with do_bench
(L2 flushed before each replay), plus the eager do_bench time for contrast. Since a capture now changes flash's
choice itself (flash_hopper.REPLAYED_FORWARD_MIN_SCORES), each flash case pins its kernels in both passes.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/short_problems_gpu_time.py
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
import triton

from attention import flash_hopper, get_attention
from benchmarking.timing import captured
from tests.gpu.experiments.short_sequence_host_vs_gpu import forced_min_scores

SHAPES = [(4, 20, 1024, 64), (16, 12, 1024, 64), (8, 16, 1024, 128), (1, 16, 4096, 64), (2, 16, 2048, 64),
          (1, 16, 8192, 64)]


@contextlib.contextmanager
def pinned(kernels: str):
    """flash on its "hopper" or its "triton" kernels in both passes, captured or not; "any" leaves the choice."""
    if kernels == "hopper":
        with forced_min_scores(0), mock.patch.object(flash_hopper, "REPLAYED_FORWARD_MIN_SCORES", {}):
            yield
    elif kernels == "triton":
        with mock.patch.dict(os.environ, {"FLASH_HOPPER_FORWARD": "0", "FLASH_HOPPER_BACKWARD": "0"}):
            yield
    else:
        yield


def main() -> None:
    torch.manual_seed(0)
    print(f"{'shape':22s} {'pass':7s} {'backend':15s} {'graphed ms':>10s} {'eager ms':>9s}")
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        cases = {"flash (triton)": ("flash", "triton"), "flash (hopper)": ("flash", "hopper"),
                 "sdpa-cudnn": ("sdpa-cudnn", "any")}
        results = {}
        for label, (name, kernels) in cases.items():
            attn = get_attention(name)
            for pass_name in ("fwd", "fwd+bwd"):
                def run(attn=attn, pass_name=pass_name):
                    out = attn(q, k, v, causal=True)
                    if pass_name == "fwd+bwd":
                        out.backward(do)
                with pinned(kernels):
                    replay = captured(run, "cuda", grad_to_none=(q, k, v))
                    graph_ms = triton.testing.do_bench(replay, warmup=25, rep=200)

                    def eager():
                        q.grad = k.grad = v.grad = None
                        run()
                    eager_ms = triton.testing.do_bench(eager, warmup=25, rep=200)
                results[(pass_name, label)] = graph_ms
                print(f"{str((b, h, n, d)):22s} {pass_name:7s} {label:15s} {graph_ms:10.4f} {eager_ms:9.4f}")
        for pass_name in ("fwd", "fwd+bwd"):
            hopper, triton_ms, cudnn = (results[(pass_name, x)] for x in ("flash (hopper)", "flash (triton)",
                                                                         "sdpa-cudnn"))
            print(f"SUMMARY {str((b, h, n, d)):22s} {pass_name:7s} graphed hopper/triton {hopper / triton_ms:.3f} "
                  f"hopper/cuDNN {hopper / cudnn:.3f} triton/cuDNN {triton_ms / cudnn:.3f}")
        del q, k, v, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
