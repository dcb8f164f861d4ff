"""The Hopper kernels' tiles, and the rules that choose them for a problem (forward: tiles_for; backward:
backward_tiles_for)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# A Hopper program pays its start and end (Q's load, the pipeline's fill, O's store) once. With few key tiles per row
# (documents, windows under this many keys) the forward runs persistent instead: a program per SM takes work items one
# after another, the next one's loads overlapping the last one's end; longer rows hide a program's start themselves
# (docs/flash.md, The persistent forward).
PERSISTENT_MAX_WINDOW = 3072
THREE_CONSUMERS_MIN_WINDOW = 512  # windows from here, and documents alone, run three consumers; the others two
# At d 128 two consumers on 128-key tiles in three slots (224 of an SM's 227 KB) beat three consumers on 64-key tiles
# without a mask, and with a causal mask from this many rows on (docs/flash.md, Hopper tiles).
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
    program) when that still gives every SM four programs, else two (docs/flash.md, Hopper tiles).
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


# The fused backward's registers per thread with a dQ warpgroup (d 64): the second dK/dV consumer's and the dQ
# warpgroup's. The producer warp keeps 24 and the first consumer gets what is left of an SM's 65536 (488 minus both,
# per thread of the four warpgroups): 208, the most that compiles without spills.
FUSED_REGS = (208, 72)


def fused_dq_cols(d: int, consumers: int) -> int:
    """Columns of d in one dQ tile of the fused backward: all of d, by a dQ warpgroup of its own, at d 64; from d 128,
    where that warpgroup's registers would make the dK/dV consumers spill, each consumer's share."""
    return d if d <= 64 else d // consumers


def backward_tiles_for(d: int, n: int, batch_heads: int, sm_count: int, fused: bool = False) -> dict[str, HopperTiles]:
    """dK/dV and dQ tiles: 64 resident rows per consumer; 64-row streamed tiles (32 for dK/dV at d 128, where the fused
    backward, `fused`, streams 64-row tiles in three slots: its consumers hold one score tile pair at a time).

    dK/dV keeps two consumers (three get 160 registers each, too few for its two accumulators and two score tiles)
    and four slots (it issues the next tile's S^T before it releases the tile before, which with three slots waits on
    the load). dQ at d 64 takes three consumers, as the forward does, when every SM still gets four programs. Each
    choice was the fastest of the configs timed against it (docs/flash.md, Hopper tiles).
    """
    if d == 128:
        return {"dkdv": HopperTiles(2, 64, 3) if fused else HopperTiles(2, 32, 4), "dq": HopperTiles(2, 64, 4)}
    dq = HopperTiles(3, 64, 4)
    if batch_heads * math.ceil(n / dq.rows) < 4 * sm_count:
        dq = HopperTiles(2, 64, 4)
    return {"dkdv": HopperTiles(2, 64, 4), "dq": dq}
