"""Sweep the tiles of each of flash's Triton kernels (the other kernels at their tuned config), bf16, on a CUDA GPU.

Prints the five fastest configs per kernel and shape, and the autotuner's pick: what SEARCH_SPACES in
attention/flash/triton/host.py were chosen from. Needs autotuning on (do not set FLASH_ATTN_AUTOTUNE=0).

    python scripts/flash_tile_sweep.py [fwd] [dkdv] [dq]      # default: all three
"""
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from attention.flash.triton import host as ft  # noqa: E402  the Triton kernels directly, never the Hopper ones
from attention.flash.triton.host import Tiles as T  # noqa: E402

CANDIDATES = {
    "fwd": [T(64, 64, 4, 3), T(64, 64, 4, 4), T(128, 64, 4, 3), T(128, 64, 8, 3), T(128, 64, 8, 4), T(128, 64, 4, 4),
            T(128, 128, 8, 2), T(128, 128, 8, 3), T(128, 32, 4, 4), T(64, 32, 4, 4), T(128, 128, 4, 2)],
    "dkdv": [T(16, 64, 4, 3), T(16, 128, 8, 3), T(32, 64, 4, 3), T(32, 64, 4, 4), T(32, 64, 8, 3), T(32, 128, 4, 3),
             T(32, 128, 8, 2), T(32, 128, 8, 3), T(32, 128, 8, 4), T(64, 64, 4, 2), T(64, 64, 4, 3), T(64, 64, 8, 3),
             T(64, 128, 8, 2), T(64, 128, 8, 3), T(64, 128, 4, 2), T(128, 128, 8, 2)],
    "dq": [T(64, 32, 4, 3), T(64, 64, 4, 3), T(64, 64, 4, 4), T(128, 32, 4, 3), T(128, 32, 8, 3), T(128, 64, 4, 3),
           T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 64, 8, 4), T(128, 128, 8, 2), T(128, 128, 8, 3), T(64, 16, 4, 4),
           T(128, 16, 4, 4)],
}


def main() -> None:
    kernels = sys.argv[1:] or list(CANDIDATES)
    unknown = set(kernels) - set(CANDIDATES)
    if unknown or not torch.cuda.is_available():
        sys.exit(f"usage: {sys.argv[0]} [fwd] [dkdv] [dq] (on a CUDA GPU)")
    shapes = [(1, 16, 16384, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 64, False), (1, 16, 4096, 64, True)]
    for b, h, n, d, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d ** -0.5
        o, lse = ft.forward(q, k, v, causal, scale)
        ft.backward(q, k, v, o, lse, do, causal, scale)
        tuned = {kern: ft._tuned[ft._tuned_key(kern, (n, n), ft._meta(q, causal), q)] for kern in ("fwd", "dkdv", "dq")}
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        print(f"\n{(b, h, n, d, causal)} tuned {tuned}", flush=True)
        for kern in kernels:
            cands = CANDIDATES[kern]
            rows = []
            for t in cands:
                try:
                    if kern == "fwd":
                        fn = lambda: ft.forward(q, k, v, causal, scale, tiles=t)  # noqa: E731
                        err = (fn()[0].float() - ref).abs().max().item()
                    else:
                        tiles = {**tuned, kern: t}
                        fn = lambda: ft.backward(q, k, v, o, lse, do, causal, scale, tiles=tiles)  # noqa: E731
                        fn()
                        err = 0.0
                    rows.append((do_bench(fn, warmup=10, rep=100), t, err))
                except Exception as e:  # noqa: BLE001
                    print(f"  {kern} {t}: FAILED {type(e).__name__}", flush=True)
            rows.sort(key=lambda r: r[0])
            for ms, t, err in rows[:5]:
                mark = " (tuned)" if t == tuned[kern] else ""
                print(f"  {kern} {ms:.3f} ms {t}{mark} err {err:.1e}", flush=True)
            tuned_rows = [r for r in rows if r[1] == tuned[kern]]
            if tuned_rows and tuned_rows[0] not in rows[:5]:
                print(f"  {kern} {tuned_rows[0][0]:.3f} ms {tuned[kern]} (tuned)", flush=True)


if __name__ == "__main__":
    main()
