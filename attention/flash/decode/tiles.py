"""flash's decode tiles, and the rule that splits a cache's keys among programs (host.py launches what they say).

A decode step reads the cache once, so what decides its time is how many programs read at once and how long each
runs: a program per SM slot, one wave, each reading an equal chunk, was fastest at every point of the sweep on the
H200 (`python scripts/decode_bench.py --sweep`; docs/flash.md, Decode).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_SPLITS = 128  # the combine kernel holds all of a row's chunks at once


@dataclass(frozen=True)
class DecodeTiles:
    """A partial-kernel program streams (block_n, d_head) tiles of K and V in `num_stages` pipeline stages with
    `num_warps` warps; `programs_per_sm` of them share an SM in the wave the split count aims for."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int


# By padded head dim, the sweep's fastest with their best split counts: 64-key tiles and two programs an SM at d 64
# and below; 128-key tiles and one program an SM at d 128 (three stages of K and V: 192 KB of shared memory); 64-key
# tiles and 8 warps at d 256 (the same 192 KB).
_TILES = {64: DecodeTiles(64, 4, 3, 2), 128: DecodeTiles(128, 4, 3, 1), 256: DecodeTiles(64, 8, 3, 1)}
INTERPRET_TILES = DecodeTiles(128, 4, 1, 1)  # the CPU interpreter: short test caches still span several chunks


def tiles_for(block_d: int, interpreting: bool = False) -> DecodeTiles:
    """The tiles of a head dim padded to the power of two `block_d` (16 to 256)."""
    if interpreting:
        return INTERPRET_TILES
    return _TILES[max(64, block_d)]


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(blocks: int, keys: int, device: torch.device, tiles: DecodeTiles) -> int:
    """Chunks per block of query rows: as many as keep every program of the `blocks` in one wave of
    tiles.programs_per_sm per SM, each chunk at least one tile of the `keys` a block can see, at most MAX_SPLITS.

    Depends only on shapes (the cache's capacity, not its filled length), so a captured decode step keeps it.
    """
    fit = max(1, -(-keys // tiles.block_n))
    if device.type != "cuda":
        return max(1, min(4, fit))
    return max(1, min(MAX_SPLITS, tiles.programs_per_sm * _sm_count(device) // blocks, fit))
