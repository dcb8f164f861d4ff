"""The Hopper kernels' tiles (attention/flash/hopper/tiles.py): the rules that choose them, and that what they choose
fits the kernels (whole tiles of SEQ_MULTIPLE rows, one SM's shared memory)."""

from __future__ import annotations

from attention.flash.hopper.inputs import HEAD_DIMS, SEQ_MULTIPLE
from attention.flash.hopper.tiles import (PERSISTENT_MAX_WINDOW, THREE_CONSUMERS_MIN_WINDOW,
                                          WIDE_KEY_TILES_MIN_CAUSAL_SEQ, HopperTiles, backward_tiles_for, fused_dq_cols,
                                          tiles_for)


def test_three_consumers_only_when_every_sm_gets_four_programs():
    assert tiles_for(64, 16384, 16, 132).consumers == 3  # 16 * 86 programs
    assert tiles_for(64, 4096, 16, 132).consumers == 2  # 16 * 22 = 352 < 528
    assert not tiles_for(64, 16384, 16, 132).persistent


def test_d128_takes_128_key_tiles_without_a_mask_and_on_long_causal_rows():
    wide = HopperTiles(consumers=2, block_n=128, stages=3)
    long_rows = WIDE_KEY_TILES_MIN_CAUSAL_SEQ
    assert tiles_for(128, 1024, 16, 132, causal=False) == wide
    assert tiles_for(128, long_rows, 16, 132, causal=True) == wide
    assert tiles_for(128, long_rows // 2, 128, 132, causal=True) == HopperTiles(3, 64, 3)
    assert tiles_for(128, long_rows, 16, 132, window=PERSISTENT_MAX_WINDOW).block_n == 64
    assert tiles_for(64, long_rows, 64, 132, causal=False).consumers == 3  # d 64 keeps three consumers
    # one query block, three slots of K and V tiles: 224 of an H100 SM's 227 KB of shared memory
    assert (wide.rows + 2 * wide.stages * wide.block_n) * 128 * 2 <= 227 * 1024


def test_short_key_ranges_run_the_persistent_forward():
    for d in HEAD_DIMS:
        assert tiles_for(d, 16384, 16, 132, docs=True).persistent
        assert tiles_for(d, 16384, 16, 132, window=PERSISTENT_MAX_WINDOW - 1).persistent
        assert not tiles_for(d, 16384, 16, 132, window=PERSISTENT_MAX_WINDOW).persistent
        # three consumers for documents alone and for longer windows, two for both together and short windows
        assert tiles_for(d, 16384, 16, 132, docs=True).consumers == 3
        assert tiles_for(d, 16384, 16, 132, window=1024, docs=True).consumers == 2
        assert tiles_for(d, 16384, 16, 132, window=PERSISTENT_MAX_WINDOW - 1, docs=True).consumers == 2
        assert tiles_for(d, 16384, 16, 132, window=THREE_CONSUMERS_MIN_WINDOW - 1).consumers == 2
        assert tiles_for(d, 16384, 16, 132, window=THREE_CONSUMERS_MIN_WINDOW).consumers == 3
        for window in (None, 256, 1024):
            t = tiles_for(d, 16384, 16, 132, window=window, docs=window is None)
            q_buffers = 2 * t.consumers * t.block_m  # the persistent forward's two buffers of query rows
            assert (q_buffers + 2 * t.stages * t.block_n) * d * 2 <= 227 * 1024
    for d in HEAD_DIMS:
        for t in (tiles_for(d, 16384, 16, 132), tiles_for(d, 128, 1, 132)):
            assert SEQ_MULTIPLE % t.block_n == 0 and SEQ_MULTIPLE % t.block_m == 0


def test_backward_tiles():
    assert backward_tiles_for(64, 16384, 16, 132)["dq"].consumers == 3
    assert backward_tiles_for(64, 4096, 16, 132)["dq"].consumers == 2
    for d in HEAD_DIMS:
        for n, bh in ((16384, 16), (128, 1)):
            for kernel, t in backward_tiles_for(d, n, bh, 132).items():
                assert SEQ_MULTIPLE % t.block_n == 0 and SEQ_MULTIPLE % t.block_m == 0
                # two resident and `stages` pairs of streamed bf16 tiles, and for dK/dV the streamed tiles' fp32 L
                # and delta, in one SM's 227 KB of shared memory
                stats = 2 * t.stages * t.block_n * 4 if kernel == "dkdv" else 0
                assert (2 * t.rows + 2 * t.stages * t.block_n) * d * 2 + stats <= 227 * 1024


def test_fused_backward_tiles_fit_shared_memory():
    """The fused dK/dV program holds, on top of the dK/dV kernel's tiles, two buffers of both consumers' bf16 dS^T and
    fp32 staging for its dQ tiles: two buffers of all of d with a dQ warpgroup, one per consumer of its share of d."""
    for d in HEAD_DIMS:
        t = backward_tiles_for(d, 16384, 16, 132, fused=True)["dkdv"]
        cols = fused_dq_cols(d, t.consumers)
        assert cols == (d if d == 64 else d // t.consumers) and cols % 16 == 0
        stats = 2 * t.stages * t.block_n * 4
        ds = 2 * t.rows * t.block_n * 2
        staging = 2 * t.block_n * cols * 4 if cols == d else t.consumers * t.block_n * cols * 4
        assert (2 * t.rows + 2 * t.stages * t.block_n) * d * 2 + stats + ds + staging <= 227 * 1024
