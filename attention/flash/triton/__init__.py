"""flash's FlashAttention-2 kernels in Triton, for every input flash takes: host.py (tiles, autotuning, launches,
plans), kernels.py (the @triton.jit kernels, imported on first use)."""
