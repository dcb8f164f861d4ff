"""flash's decode tiles, and the rule that splits a cache's keys among programs (host.py launches what they say).

A decode step reads the cache once; what decides its time is how many programs read at once and how long each runs.
The split count aims at one wave: every program of the step running at once, each over an equal number of key tiles
(`python scripts/decode_bench.py --sweep` times the alternatives; docs/flash.md, Decode).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from attention.flash.common import sm_count

MAX_SPLITS = 128  # the combine kernel holds all of a row's chunks at once
LONG_CHUNK_TILES = 32  # d 64 on the H200: four stages ran up to 5% faster above it, up to 4% slower below it


@dataclass(frozen=True)
class DecodeTiles:
    """A partial-kernel program streams (block_n, d_head) tiles of K and V in `num_stages` pipeline stages with
    `num_warps` warps; `programs_per_sm` of them share an SM in the wave the split count aims for. A chunk of more
    than LONG_CHUNK_TILES tiles takes `long_chunk_stages` stages where that is set (for_chunks)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    long_chunk_stages: Optional[int] = None

    def for_chunks(self, keys: int, num_splits: int) -> DecodeTiles:
        """These tiles for `keys` keys cut into `num_splits` chunks: with long_chunk_stages where a chunk holds more
        than LONG_CHUNK_TILES tiles. A deeper pipeline keeps more of the cache in flight, and its prologue, a tile a
        stage, is paid once a chunk."""
        key_tiles = -(-keys // self.block_n)
        if self.long_chunk_stages is None or -(-key_tiles // num_splits) <= LONG_CHUNK_TILES:
            return self
        return dataclasses.replace(self, num_stages=self.long_chunk_stages, long_chunk_stages=None)


# By padded head dim, for 16-bit caches: 64-key tiles and two programs an SM at d 64 and below (four stages for long
# chunks), 128-key tiles and one program an SM at d 128, 64-key tiles with 8 warps at d 256 (docs/flash.md, Decode).
_TILES = {64: DecodeTiles(64, 4, 3, 2, long_chunk_stages=4), 128: DecodeTiles(128, 4, 3, 1),
          256: DecodeTiles(64, 8, 3, 1)}
INTERPRET_TILES = DecodeTiles(128, 4, 1, 1)  # the CPU interpreter takes no launch options; its tiles are d 128's


def tiles_for(block_d: int, element_bytes: int = 2, interpreting: bool = False) -> DecodeTiles:
    """The tiles of a head dim padded to the power of two `block_d` (16 to 256), for caches of `element_bytes`."""
    if interpreting:
        return INTERPRET_TILES
    if block_d > 256:
        raise ValueError(f"flash's decode tiles go up to a head dim of 256, got a padded head dim of {block_d}")
    tiles = _TILES[max(64, block_d)]
    if element_bytes > 2:  # fp32 tiles take twice the shared memory: no deeper pipeline, and half the keys from d 128
        tiles = dataclasses.replace(tiles, long_chunk_stages=None,
                                    block_n=tiles.block_n // 2 if block_d >= 128 else tiles.block_n)
    return tiles


def default_num_splits(blocks: int, keys: int, device: torch.device, tiles: DecodeTiles) -> int:
    """Chunks per block of query rows: as many as keep every program of the `blocks` in one wave of
    tiles.programs_per_sm per SM, at most MAX_SPLITS, then as few as split the `keys` a block can see into chunks
    of as many whole tiles each (so that none is empty).

    Depends only on shapes (the cache's capacity, not its filled length), so a captured decode step keeps it.
    """
    key_tiles = max(1, -(-keys // tiles.block_n))
    if device.type != "cuda":
        wanted = 4
    else:
        wanted = max(1, tiles.programs_per_sm * sm_count(device.index or 0) // blocks)
    tiles_per_chunk = -(-key_tiles // min(MAX_SPLITS, wanted, key_tiles))
    return -(-key_tiles // tiles_per_chunk)
