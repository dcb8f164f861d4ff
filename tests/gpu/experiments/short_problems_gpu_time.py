"""Experiment: below flash_hopper.MIN_SCORES, are the Hopper kernels faster than flash's Triton kernels once host
time is out of the picture (a CUDA graph replays the launches)?

MIN_SCORES keeps problems under 2^28 scores on the Triton kernels because the Gluon launches cost more host time.
Inside a captured CUDA graph that cost is paid once, at capture. For each shape (causal, bf16, (batch, heads, seq,
d) storage): forward and forward+backward of flash on its Triton kernels, flash forced onto the Hopper kernels
(MIN_SCORES = 0) and SDPA's cuDNN kernel, each captured once in a CUDA graph and its replay timed with do_bench
(L2 flushed before each replay), plus the eager do_bench time for contrast.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/short_problems_gpu_time.py
"""

from __future__ import annotations

import contextlib

import torch
import triton

from attention import flash_hopper, get_attention

SHAPES = [(4, 20, 1024, 64), (16, 12, 1024, 64), (8, 16, 1024, 128), (1, 16, 4096, 64), (2, 16, 2048, 64),
          (1, 16, 8192, 64)]


@contextlib.contextmanager
def min_scores(value):
    saved = flash_hopper.MIN_SCORES
    flash_hopper.MIN_SCORES = value
    try:
        yield
    finally:
        flash_hopper.MIN_SCORES = saved


def graphed(run, leaves):
    """run() captured in a CUDA graph after a warm-up on a side stream; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in leaves:
                t.grad = None
            run()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def main() -> None:
    torch.manual_seed(0)
    print(f"{'shape':22s} {'pass':7s} {'backend':15s} {'graphed ms':>10s} {'eager ms':>9s}")
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        cases = {"flash (triton)": ("flash", None), "flash (hopper)": ("flash", 0), "sdpa-cudnn": ("sdpa-cudnn", None)}
        results = {}
        for label, (name, forced) in cases.items():
            attn = get_attention(name)
            for pass_name in ("fwd", "fwd+bwd"):
                def run(attn=attn, pass_name=pass_name):
                    out = attn(q, k, v, causal=True)
                    if pass_name == "fwd+bwd":
                        out.backward(do)
                with min_scores(forced) if forced is not None else contextlib.nullcontext():
                    replay = graphed(run, (q, k, v))
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
