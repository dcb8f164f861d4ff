"""Host side of flash's Hopper forward (flash_hopper_kernels.py): when it applies, its tiles, the launch.

flash_triton.flash_forward asks `forward_problem` first and runs this kernel when the answer is None. Every other
input keeps the Triton kernel: other GPUs, fp32, other head dims, sequences that are not whole tiles, problems small
enough to be bound by host time, the CPU interpreter, forced Triton tiles. The backward is flash's Triton backward
either way. FLASH_HOPPER_FORWARD=0 turns it off.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
SEQ_MULTIPLE = 128  # whole query and key tiles: a tile past the end would read the next head's rows
MAX_PROGRAM_ROWS = 65535  # batch * heads goes on CUDA grid axis 1
# Scores are batch * heads * n^2, halved when causal. At 2^27 (B1 H16 N4096 causal) the kernel takes 0.12 ms, and
# the Gluon launch's host time decides: 114-147 us per call against 72-95 us for the Triton kernel's, measured in
# the same runs on the H100 (results/README.md, seventh session).
MIN_SCORES = 2**28


@dataclass(frozen=True)
class HopperTiles:
    """One program: `consumers` warpgroups of `block_m` query rows; key tiles of `block_n` in `stages` slots."""

    consumers: int
    block_n: int
    stages: int
    block_m: int = 64  # one warpgroup's wgmma rows

    @property
    def rows(self) -> int:
        return self.block_m * self.consumers

    @property
    def consumer_regs(self) -> int:
        # 65536 registers per SM shared by the consumer warpgroups and the producer's (24 per thread).
        return {2: 240, 3: 160}[self.consumers]


def tiles_for(d: int, n: int, batch_heads: int, sm_count: int) -> HopperTiles:
    """Three consumers (192 rows a program) when that still gives every SM four programs, else two.

    Measured on the H100 (results/README.md, seventh session): three consumers ran the leaderboard forward 8%
    faster than two, D128 causal 9%, D64 not causal 12%. At B1 H16 N4096 (352 programs of 192 rows on 132 SMs) two
    were 16% faster in one run and 4% slower in the next, where host time bounds both; that size now stays below
    MIN_SCORES.
    """
    block_n = 128 if d == 64 else 64
    three = HopperTiles(consumers=3, block_n=block_n, stages=3)
    if batch_heads * math.ceil(n / three.rows) >= 4 * sm_count:
        return three
    return HopperTiles(consumers=2, block_n=block_n, stages=3 if d == 64 else 4)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _gluon_problem() -> Optional[str]:
    try:
        from attention import flash_hopper_kernels  # noqa: F401
    except Exception as e:  # an older triton has no Gluon, or a Gluon API this kernel was not written for
        return f"triton's Gluon Hopper API is unavailable ({type(e).__name__}: {e})"
    return None


def _enabled() -> bool:
    return os.environ.get("FLASH_HOPPER_FORWARD", "1").strip().lower() not in ("0", "false", "off", "no")


def rows_index(t: torch.Tensor) -> Optional[tuple[int, int, int, tuple[int, int]]]:
    """(rows per batch, rows per head, columns per head, 2-D shape) of a (batch, heads, seq, d) tensor, or None.

    Row b * rows_b + h * rows_h + position of the 2-D view, from column h * cols_h, holds t[b, h, position]. That
    covers (batch, heads, seq, d) storage (one row per position of each head) and (batch, seq, heads, d) storage
    (one row per position, the heads side by side), which is what the model hands over.
    """
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    if sd != 1:
        return None

    def stride_is(size: int, stride: int, want: int) -> bool:
        return size == 1 or stride == want  # a size-1 dim's stride is arbitrary

    if stride_is(h, sh, n * d) and stride_is(n, sn, d) and stride_is(b, sb, h * n * d):  # (batch, heads, seq, d)
        return h * n, n, 0, (b * h * n, d)
    if stride_is(h, sh, d) and stride_is(n, sn, h * d) and stride_is(b, sb, n * h * d):  # (batch, seq, heads, d)
        return n, 0, d, (b * n, h * d)
    return None


def rows_view(t: torch.Tensor) -> Optional[tuple[torch.Tensor, int, int, int]]:
    """(2-D view, rows per batch, rows per head, columns per head) of t, as rows_index describes it, or None."""
    index = rows_index(t)
    if index is None:
        return None
    rows_b, rows_h, cols_h, (rows, cols) = index
    return torch.as_strided(t, (rows, cols), (cols, 1)), rows_b, rows_h, cols_h


def forward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Optional[str]:
    """Why the Hopper forward cannot run these (batch, heads, seq, d) inputs, or None when it can."""
    if not _enabled():
        return "turned off by FLASH_HOPPER_FORWARD=0"
    if not q.is_cuda:
        return "it needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "it needs an sm_90 (Hopper) GPU"
    if q.dtype not in DTYPES:
        return f"it supports float16 and bfloat16, not {q.dtype}"
    d, n = q.shape[-1], q.shape[-2]
    if d not in HEAD_DIMS:
        return f"it supports head dims {HEAD_DIMS}, not {d}"
    if k.shape[-2] != n:
        return f"it needs as many keys as queries, got {k.shape[-2]} and {n}"
    if n % SEQ_MULTIPLE:
        return f"it needs the sequence length to be a multiple of {SEQ_MULTIPLE}, got {n}"
    scores = q.shape[0] * q.shape[1] * n * n // (2 if causal else 1)
    if scores < MIN_SCORES:
        return f"{scores} scores are too few: below {MIN_SCORES} host time outweighs the faster kernel"
    if q.shape[0] * q.shape[1] > MAX_PROGRAM_ROWS:
        return f"it runs at most {MAX_PROGRAM_ROWS} (batch, head) pairs, got {q.shape[0] * q.shape[1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if rows_index(t) is None:  # the index alone: forward builds the views, once
            return f"{name} is neither (batch, heads, seq, d) nor (batch, seq, heads, d) in memory"
    return _gluon_problem()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
            scale: float, tiles: Optional[HopperTiles] = None) -> None:
    """Write o (q's memory order) and lse ((batch * heads, seq) fp32, natural log) for accepted inputs."""
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attention.flash_hopper_kernels import attn_fwd_hopper

    b, h, n, d = q.shape
    t = tiles or tiles_for(d, n, b * h, _sm_count(q.device.index or 0))
    if n % t.block_m or n % t.block_n:
        raise ValueError(f"sequence length {n} is not a multiple of the tiles {t.block_m} and {t.block_n}")
    elem = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    (q2, q_rb, q_rh, q_ch), (k2, k_rb, k_rh, k_ch), (v2, v_rb, v_rh, v_ch) = map(rows_view, (q, k, v))
    o2, *o_index = rows_view(o)
    if tuple(o_index) != (q_rb, q_rh, q_ch):
        raise ValueError("o must be in q's memory order")

    def desc(t2: torch.Tensor, block: list[int]):
        return TensorDescriptor.from_tensor(t2, block, gl.NVMMASharedLayout.get_default_for(block, elem))

    attn_fwd_hopper[(triton.cdiv(n, t.rows), b * h)](
        desc(q2, [t.block_m, d]), desc(k2, [t.block_n, d]), desc(v2, [t.block_n, d]), desc(o2, [t.block_m, d]),
        lse, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, h, n, scale * math.log2(math.e),
        CAUSAL=causal, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.stages, NUM_CONSUMERS=t.consumers,
        CONSUMER_REGS=t.consumer_regs, num_warps=4,
    )
