"""The Hopper kernels' tiles, and the rules that choose them for a problem (forward: tiles_for; backward:
backward_tiles_for)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# A Hopper program holds an SM alone and pays its start and end (Q's load, the pipeline's fill, O's store) once. With
# few key tiles per row (documents, windows under this many keys) the forward runs persistent: a program per SM takes
# work items one after another, the next one's loads overlapping the last one's end. Kernel times (CUDA-graph replay)
# on the H100 at B1 H16 N16384 causal, persistent (64-key tiles) against a program per item and against the Triton
# forward: documents of mean length 1024 0.214 against 0.451 and 0.241 ms (0.205 with its items taken longest first,
# hopper_kernels._work_item). Windows, d 64, two / three consumers against a program per item: 256 keys 0.095 / 0.109
# against 0.201; 512 0.140 / 0.135 against 0.213; 1024 0.230 / 0.210 against 0.273; 2048 0.408 / 0.368 against 0.381;
# 3072 0.586 / 0.517 against 0.491 (longer rows hide a program's start). d 128: 256 keys 0.128 / 0.151; 1024 0.307 /
# 0.290 against 0.306. Documents, their items taken longest first, run three consumers: kernel alone, two / three, d 64
# mean length 1024 0.190 / 0.179 and 0.212 / 0.194 (two draws), 256 0.124 / 0.121, 4096 0.534 / 0.493, with GQA KV4
# 0.187 / 0.173; d 128 0.313 / 0.283. With a window as well they keep two: 1024 keys 0.181 / 0.205, 256 0.121 / 0.145,
# with GQA KV4 0.178 / 0.192 (results/h100/2026-11-28-flash-hopper-persistent-consumers.txt).
PERSISTENT_MAX_WINDOW = 3072
THREE_CONSUMERS_MIN_WINDOW = 512
# At d 128 two consumers streaming 128-key tiles in three slots (224 of an SM's 227 KB) ran faster than three consumers
# on 64-key tiles without a mask at every length tried, and with a causal mask from this length on faster or level
# (slower below it). Medians of 2-3 rounds taking turns, bf16, ms: not causal, B8 H16 N2048 0.473 against 0.504 (H200),
# B4 H16 N4096 0.904 against 0.960 (H200), B2 H16 N8192 1.701 against 1.830-1.983 (H100); causal, B4 H16 N4096 0.531
# against 0.546 (H200), B2 H16 N8192 0.942-0.950 against 0.955-1.000 (H100), GQA B4 H32 KV8 N8192 3.567-3.586 against
# 3.779-4.471 (H100), B1 H32 N32768 13.58-14.28 against 13.80 (H100), B1 H16 N16384 1.946 against 1.920 (H200, rounds
# 1.818-1.955); shorter causal rows took longer, B8 H16 N2048 0.305 against 0.299 (H200).
# results/h{100,200}/2026-11-28-flash-hopper-d128-*tiles.txt
WIDE_KEY_TILES_MIN_CAUSAL_SEQ = 4096


@dataclass(frozen=True)
class HopperTiles:
    """One program: `consumers` warpgroups of `block_m` resident rows; streamed tiles of `block_n` rows in `stages`
    slots. The forward and dQ keep query rows and stream keys; dK/dV keeps key rows and streams queries."""

    consumers: int
    block_n: int
    stages: int
    block_m: int = 64  # one warpgroup's wgmma rows
    persistent: bool = False  # the forward only: a program per SM runs work items one after another

    @property
    def rows(self) -> int:
        return self.block_m * self.consumers

    @property
    def consumer_regs(self) -> int:
        # 65536 registers per SM shared by the consumer warpgroups and the producer's (24 per thread).
        return {2: 240, 3: 160}[self.consumers]


def tiles_for(d: int, n: int, batch_heads: int, sm_count: int, window: Optional[int] = None,
              docs: bool = False, causal: bool = True) -> HopperTiles:
    """The forward's tiles: persistent for short key ranges (documents, windows under PERSISTENT_MAX_WINDOW), with
    three consumers for documents alone and for windows from THREE_CONSUMERS_MIN_WINDOW keys without documents, two
    for documents with a window and for shorter windows; at d 128 without a window, when not causal or from
    WIDE_KEY_TILES_MIN_CAUSAL_SEQ causal rows, two consumers on 128-key tiles; otherwise three consumers (192 rows a
    program) when that still gives every SM four programs, else two.

    Measured on the H100: three consumers ran the B1 H16 N16384 d 64 causal forward 8% faster than two, d 128
    causal 9% (both on 64-key tiles), d 64 not causal 12%. At B1 H16 N4096 (352 programs of 192 rows on 132 SMs) two
    were 16% faster in one run and 4% slower in the next, where host time bounds both; that size now stays below
    MIN_SCORES.
    """
    if docs or (window is not None and window < PERSISTENT_MAX_WINDOW):
        if window is not None and (docs or window < THREE_CONSUMERS_MIN_WINDOW):
            return HopperTiles(consumers=2, block_n=64, stages=4, persistent=True)
        # d 128: three slots, as the plain three-consumer forward there (four would take 224 of an SM's 227 KB).
        return HopperTiles(consumers=3, block_n=64, stages=4 if d == 64 else 3, persistent=True)
    if d == 128 and window is None and (not causal or n >= WIDE_KEY_TILES_MIN_CAUSAL_SEQ):
        return HopperTiles(consumers=2, block_n=128, stages=3)
    block_n = 128 if d == 64 else 64
    three = HopperTiles(consumers=3, block_n=block_n, stages=3)
    if batch_heads * math.ceil(n / three.rows) >= 4 * sm_count:
        return three
    return HopperTiles(consumers=2, block_n=block_n, stages=3 if d == 64 else 4)


def backward_tiles_for(d: int, n: int, batch_heads: int, sm_count: int) -> dict[str, HopperTiles]:
    """dK/dV and dQ tiles: 64 resident rows per consumer; 64-row streamed tiles (32 for dK/dV at d 128).

    Measured on the H100, each against the other configs in the same run:
    - dK/dV keeps two consumers. Three get 160 registers each, too few for its two accumulators and two score tiles
      (they spill), except with 32-row query tiles, which ran 8-13% slower than two consumers' best. Four slots:
      it issues the next tile's S^T before it releases the tile before, and with three slots that waits on the
      load (9-13% slower without a mask than four slots).
    - dQ at d 64 takes three consumers, as the forward does, when that still gives every SM four programs: 5-9%
      faster than two at N16384. At d 128 three consumers ran 44% slower than two.
    - dK/dV at d 128 keeps 32-row query tiles. Since L and delta moved to shared memory, 64-row tiles no longer
      spill inside the loop (`python -m attention.flash.hopper.resources dkdv,128,2,64,4`), but they ran 2% slower
      (causal) and 1% slower (not causal) at B2 H16 N8192. dQ with two key tiles of 128 rows at d 64 ran 18-27%
      slower than three consumers.
    """
    if d == 128:
        return {"dkdv": HopperTiles(2, 32, 4), "dq": HopperTiles(2, 64, 4)}
    dq = HopperTiles(3, 64, 4)
    if batch_heads * math.ceil(n / dq.rows) < 4 * sm_count:
        dq = HopperTiles(2, 64, 4)
    return {"dkdv": HopperTiles(2, 64, 4), "dq": dq}
