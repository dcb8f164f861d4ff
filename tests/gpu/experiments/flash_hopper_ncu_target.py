"""One flash forward+backward per shape, for Nsight Compute to profile the Gluon Hopper kernels (see
run_hopper_ncu_session.sh). Each shape runs twice: the first compiles and warms up, ncu's --launch-skip drops it.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_hopper_ncu_target.py B H N D causal"""

import sys

import torch

from attention.flash_triton import FlashAttentionTriton

b, h, n, d = (int(x) for x in sys.argv[1:5])
causal = sys.argv[5] == "1"
torch.manual_seed(0)
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    FlashAttentionTriton.apply(q, k, v, causal).backward(do)
torch.cuda.synchronize()
print("done", b, h, n, d, causal)
