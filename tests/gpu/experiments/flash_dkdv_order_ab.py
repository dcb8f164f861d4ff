"""A/B in one run: flash's dK/dV kernel with its matmuls in the new order (S, dP, P, dV, dS, dK) against the old one
(S, P, dV, dP, dS, dK), both in the real kernel module, at every dkdv config of the search space, with dq fixed.

The old module is the current kernel source with the old loop body put back (text replacement, checked), imported
under another name; flash_backward launches whichever module `ft._kernel_module` holds when tiles are forced.
Times are whole backward passes (delta, dkdv, dq; do_bench medians), old and new alternating per config.
Usage: PYTHONPATH=. python3 tests/gpu/experiments/flash_dkdv_order_ab.py"""

import importlib.util
import inspect
import tempfile

import torch
from triton.testing import do_bench

from attention import flash_triton as ft
from attention.flash_triton import Tiles

NEW = """        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
"""
OLD = """        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
"""
SHAPES = [(1, 16, 16384, 64, True), (2, 16, 8192, 64, False), (2, 16, 8192, 128, True), (1, 16, 4096, 64, True)]


def old_module():
    new_mod = ft._kernels()
    src = inspect.getsource(new_mod)
    assert src.count(NEW) == 1, "the new loop body is not in the kernel source"
    path = tempfile.mktemp(suffix="_flash_kernels_old_order.py")
    with open(path, "w") as f:
        f.write(src.replace(NEW, OLD))
    spec = importlib.util.spec_from_file_location("flash_kernels_old_order", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return new_mod, mod


def main():
    new_mod, old_mod = old_module()
    for b, h, n, d, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d ** -0.5
        o, lse = ft.flash_forward(q, k, v, causal, scale)
        dq_tiles = Tiles(128, 64, 8, 3)
        print(f"\n{(b, h, n, d, causal)} dq fixed at {dq_tiles}", flush=True)
        for t in ft.DKDV_SEARCH_SPACE:
            ms, grads = {}, {}
            try:
                for name, mod in (("old", old_mod), ("new", new_mod), ("old2", old_mod), ("new2", new_mod)):
                    ft._kernel_module = mod
                    tiles = {"dkdv": t, "dq": dq_tiles}
                    grads[name] = ft.flash_backward(q, k, v, o, lse, do, causal, scale, tiles=tiles)
                    ms[name] = do_bench(lambda: ft.flash_backward(q, k, v, o, lse, do, causal, scale, tiles=tiles),
                                        warmup=20, rep=150)
                same = all(torch.equal(a, b_) for a, b_ in zip(grads["old"], grads["new"]))
                old, new = min(ms["old"], ms["old2"]), min(ms["new"], ms["new2"])
                print(f"  dkdv {t}: old {old:.3f} ms, new {new:.3f} ms, new/old {new / old:.3f}, "
                      f"bitwise equal {same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  dkdv {t}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                      flush=True)
            finally:
                ft._kernel_module = new_mod


if __name__ == "__main__":
    main()
