"""flash's split-KV decode: the Triton kernels (in the interpreter without a GPU) and their PyTorch spec against
a float64 masked softmax, over GQA groups, cache lengths, batch sizes, per-row lengths, windows, softcaps and split
counts that do and do not divide the lengths."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attention.flash.decode import host, tiles
from attention.flash.decode.host import chunk_bounds, decode_reference_f64, decode_split_torch, decode_triton
from tests.attention.conftest import DEVICE, dtype_id, randn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def inputs(batch: int, group: int, length: int, n_new: int = 1, dtype=torch.float32, kv_heads: int = 1,
           d: int = 32, per_head: bool = False, seed: int = 0):
    """q (batch, kv_heads * group, n_new, d) and a cache of length + 5 positions; the first sequence is full, the
    others get random lengths in n_new..length (per head too with per_head). Every position at or past a row's
    length holds NaN: a read of one would show."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = randn(batch, heads, n_new, d, dtype=dtype, seed=seed + 1)
    k = randn(batch, kv_heads, length + 5, d, dtype=dtype, seed=seed + 2)
    v = randn(batch, kv_heads, length + 5, d, dtype=dtype, seed=seed + 3)
    cache_len = torch.randint(n_new, length + 1, (batch, heads) if per_head else (batch,), generator=g)
    cache_len[0] = length
    # A cache head's last position read is the longest length among its group's query heads.
    longest = cache_len.reshape(batch, kv_heads, group).amax(-1) if per_head else cache_len[:, None]
    tail = torch.arange(length + 5) >= longest[..., None]  # (batch, kv_heads or 1, positions)
    k[tail.to(DEVICE)[..., None].expand_as(k)] = float("nan")
    v[tail.to(DEVICE)[..., None].expand_as(v)] = float("nan")
    return q, k, v, cache_len.to(DEVICE)


def reference(q, k, v, cache_len, scale, window=None, softcap=None):
    return decode_reference_f64(q, k.nan_to_num(), v.nan_to_num(), cache_len, scale, window, softcap)


TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("length", [1, 17, 1000])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_matches_float64(group, length, dtype):
    """Batch 1 and 2 (ragged lengths), the default split count and 3 (empty chunks where the length is short)."""
    for batch in (1, 2):
        q, k, v, cache_len = inputs(batch, group, length, dtype=dtype, seed=batch)
        ref = reference(q, k, v, cache_len, 1 / math.sqrt(q.shape[-1]))
        for num_splits in (None, 3):
            o = decode_triton(q, k, v, cache_len, 1 / math.sqrt(q.shape[-1]), num_splits=num_splits)
            assert o.shape == q.shape and o.dtype == q.dtype
            torch.testing.assert_close(o.double(), ref, **TOLERANCE[dtype], msg=f"batch {batch}, {num_splits} splits")


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 8])
def test_kernel_batch_32(group):
    q, k, v, cache_len = inputs(32, group, 300, kv_heads=2, d=16, seed=5)
    o = decode_triton(q, k, v, cache_len, 0.25)
    torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.25), **TOLERANCE[torch.float32])


VARIANTS = [(None, None), (1, None), (33, None), (2000, None), (None, 5.0), (20, 2.0)]


@pytest.mark.parametrize("window,softcap", VARIANTS, ids=[f"w{w}-c{c}" for w, c in VARIANTS])
@pytest.mark.parametrize("n_new", [1, 3])
def test_kernel_variants_with_lengths_per_head(window, softcap, n_new):
    """Windows (of 1, cutting the rows, beyond the cache) and softcaps, with a length per (sequence, head): the rows
    of one group then see different keys, so a chunk may hold none of a row's."""
    q, k, v, cache_len = inputs(2, 4, 700, n_new=n_new, kv_heads=2, d=16, per_head=True, seed=7)
    ref = reference(q, k, v, cache_len, 0.3, window, softcap)
    for num_splits in (None, 5):
        o = decode_triton(q, k, v, cache_len, 0.3, num_splits=num_splits, window=window, softcap=softcap)
        torch.testing.assert_close(o.double(), ref, **TOLERANCE[torch.float32], msg=f"{num_splits} splits")


def test_kernel_many_rows_per_group():
    """A group times n_new above MAX_BLOCK_M rows: several row blocks read the same cache head."""
    q, k, v, cache_len = inputs(1, 8, 200, n_new=host.MAX_BLOCK_M // 8 + 3, d=16, seed=9)
    o = decode_triton(q, k, v, cache_len, 0.25, window=150)
    torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.25, 150), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window,softcap", VARIANTS, ids=[f"w{w}-c{c}" for w, c in VARIANTS])
@pytest.mark.parametrize("group", [1, 4])
def test_pytorch_spec_matches_float64(group, window, softcap):
    q, k, v, cache_len = (t.double() if t.is_floating_point() else t
                          for t in inputs(2, group, 1000, n_new=2, kv_heads=2, d=16, per_head=True, seed=3))
    ref = reference(q, k, v, cache_len, 0.2, window, softcap)
    for num_splits in (1, 3, 17):
        # The spec computes every score (0 * NaN would spread), so it gets the tail zeroed.
        o = decode_split_torch(q, k.nan_to_num(), v.nan_to_num(), cache_len, 0.2, num_splits, window, softcap)
        torch.testing.assert_close(o, ref, atol=1e-12, rtol=1e-12)


def test_kernel_fp16_several_new_queries():
    q, k, v, cache_len = inputs(2, 2, 300, n_new=3, dtype=torch.float16, kv_heads=2, d=64, seed=11)
    o = decode_triton(q, k, v, cache_len, 0.125, num_splits=5)
    assert o.dtype == torch.float16
    torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.125), **TOLERANCE[torch.float16])


def test_kernel_reads_strided_queries_and_an_int_length():
    """q as the model passes it: a (batch, heads, n_new, d) view of (batch, n_new, heads, d) storage."""
    q = randn(2, 1, 4, 32, seed=4).transpose(1, 2)
    _, k, v, _ = inputs(2, 2, 100, kv_heads=2, seed=4)
    k, v = k.nan_to_num(), v.nan_to_num()
    ref = decode_reference_f64(q, k, v, 100, 0.3)
    torch.testing.assert_close(decode_triton(q, k, v, 100, 0.3, num_splits=3).double(), ref, atol=2e-6, rtol=1e-5)


def test_chunks_are_whole_tiles_and_cover_the_group():
    q = torch.zeros(1, 1, 1, 8)
    lo, hi = chunk_bounds(torch.tensor([1000]), q, 1, 3, block_n=128)
    assert lo.flatten().tolist() == [0, 384, 768] and hi.flatten().tolist() == [384, 768, 1000]
    lo, hi = chunk_bounds(torch.tensor([1]), q, 1, 3, block_n=128)  # chunks past the end are empty
    assert (hi - lo).clamp(min=0).flatten().tolist() == [1, 0, 0]
    # Two cache heads of two query heads each, a length per head: a group spans its rows' keys.
    lo, hi = chunk_bounds(torch.tensor([[100, 900, 300, 200]]), torch.zeros(1, 4, 1, 8), 2, 2, window=250,
                          block_n=128)
    assert lo.tolist() == [[[0, 512], [0, 256]]] and hi.tolist() == [[[512, 900], [256, 300]]]


def test_split_count_fills_one_wave_from_shapes_only(monkeypatch):
    """As many chunks as keep every program in one wave of programs_per_sm a SM, then as few as split the keys into
    chunks of as many whole tiles each, so none is empty."""
    monkeypatch.setattr(tiles, "sm_count", lambda device_index: 132)
    cuda = torch.device("cuda", 0)
    d128, d64 = tiles.tiles_for(128), tiles.tiles_for(64)
    assert (d128.block_n, d128.programs_per_sm, d64.block_n, d64.programs_per_sm) == (128, 1, 64, 2)
    assert tiles.default_num_splits(8, 65536, cuda, d128) == 16  # batch 1, 8 cache heads: 128 programs
    assert tiles.default_num_splits(32, 2048, cuda, d128) == 4
    assert tiles.default_num_splits(40, 2048, cuda, d128) == 3  # not only powers of two
    assert tiles.default_num_splits(16, 16384, cuda, d64) == 16  # 256 programs, two an SM
    assert tiles.default_num_splits(512, 2048, cuda, d64) == 1  # batch 32, 16 cache heads: no combine
    assert tiles.default_num_splits(1, 1 << 20, cuda, d128) == tiles.MAX_SPLITS
    assert tiles.default_num_splits(8, 300, cuda, d128) == 3  # a chunk is at least a tile
    assert tiles.default_num_splits(8, 1, cuda, d128) == 1
    # 79 tiles for 33 programs: 3 tiles a chunk, so 27 chunks, none of them empty.
    assert tiles.default_num_splits(4, 5000, cuda, tiles.tiles_for(256)) == 27


@pytest.mark.parametrize("keys", [1, 63, 64, 300, 5000, 70000])
@pytest.mark.parametrize("blocks", [1, 3, 8, 40, 129, 1000])
def test_no_chunk_is_empty_at_full_capacity(monkeypatch, blocks, keys):
    monkeypatch.setattr(tiles, "sm_count", lambda device_index: 132)
    for d in (64, 128, 256):
        t = tiles.tiles_for(d)
        splits = tiles.default_num_splits(blocks, keys, torch.device("cuda", 0), t)
        lo, hi = chunk_bounds(torch.tensor([keys]), torch.zeros(1, 1, 1, d), 1, splits, block_n=t.block_n)
        assert 1 <= splits <= tiles.MAX_SPLITS and bool((hi > lo).all()), (d, splits, lo, hi)


def test_tiles_by_head_dim_and_element_size():
    """Every head dim flash decodes has tiles; fp32 halves the keys of a tile from d 128 on and takes no deeper
    pipeline for long chunks (shared memory)."""
    assert tiles.tiles_for(16) == tiles.tiles_for(32) == tiles.tiles_for(64)
    assert tiles.tiles_for(256).block_n == 64
    assert tiles.tiles_for(128, 4).block_n == 64 and tiles.tiles_for(256, 4).block_n == 32
    assert tiles.tiles_for(64, 4) == dataclasses.replace(tiles.tiles_for(64), long_chunk_stages=None)
    assert tiles.tiles_for(128, 2, interpreting=True) == tiles.INTERPRET_TILES
    with pytest.raises(ValueError, match="up to a head dim of 256"):
        tiles.tiles_for(512)


def test_long_chunks_take_a_deeper_pipeline_at_d64():
    """At d 64 (16-bit caches) a chunk of more than LONG_CHUNK_TILES key tiles streams in four stages; other tiles
    keep theirs at any length."""
    d64 = tiles.tiles_for(64)
    longest_short = d64.block_n * tiles.LONG_CHUNK_TILES * 4
    assert d64.for_chunks(longest_short, 4) == d64
    assert d64.for_chunks(longest_short + 1, 4) == dataclasses.replace(d64, num_stages=4, long_chunk_stages=None)
    assert d64.for_chunks(65536, 128).num_stages == 3  # 8 tiles a chunk
    for t in (tiles.tiles_for(128), tiles.tiles_for(256), tiles.tiles_for(64, 4), tiles.INTERPRET_TILES):
        assert t.for_chunks(1 << 20, 1) == t


def test_the_launch_takes_the_tiles_of_its_chunks(monkeypatch):
    """The partial kernel's tiles follow its chunks (DecodeTiles.for_chunks): the keys a row block can see (the
    cache's capacity, or the window's reach) over the split count."""
    seen = []
    real = tiles.DecodeTiles.for_chunks
    monkeypatch.setattr(tiles.DecodeTiles, "for_chunks",
                        lambda self, keys, splits: seen.append((keys, splits)) or real(self, keys, splits))
    host._plans.clear()
    q, k, v, cache_len = inputs(2, 4, 700, kv_heads=2, d=16, seed=31)
    decode_triton(q, k, v, cache_len, 0.3, num_splits=5)
    decode_triton(q, k, v, cache_len, 0.3, num_splits=3, window=100)
    assert seen == [(705, 5), (100, 3)]


def test_given_tiles_run_and_get_a_plan_of_their_own():
    """tiles= runs the kernel with other tiles (here 64 keys, as the GPU's at d 64) and is part of the signature."""
    host._plans.clear()
    q, k, v, cache_len = inputs(2, 4, 700, kv_heads=2, d=16, seed=29)
    ref = reference(q, k, v, cache_len, 0.3)
    small = tiles.DecodeTiles(64, 4, 1, 1)
    for t in (None, small, small):
        o = decode_triton(q, k, v, cache_len, 0.3, num_splits=5, tiles=t)
        torch.testing.assert_close(o.double(), ref, **TOLERANCE[torch.float32])
    assert len(host._plans) == 2
    spec = decode_split_torch(q, k.nan_to_num(), v.nan_to_num(), cache_len, 0.3, 5, block_n=64)
    torch.testing.assert_close(spec.double(), ref, **TOLERANCE[torch.float32])


GPU_SHAPES = [(1, 32, 8, 70000, 128), (4, 32, 8, 16384, 128), (32, 16, 16, 2048, 64), (32, 32, 32, 4096, 128),
              (1, 16, 16, 20000, 64), (2, 8, 2, 5000, 256), (3, 4, 4, 3000, 32)]


@needs_cuda
@pytest.mark.parametrize("batch,heads,kv_heads,length,d", GPU_SHAPES, ids=[
    f"B{b}-H{h}-KV{kv}-N{n}-D{d}" for b, h, kv, n, d in GPU_SHAPES])
def test_kernel_bf16_on_gpu(batch, heads, kv_heads, length, d):
    q, k, v, cache_len = inputs(batch, heads // kv_heads, length, dtype=torch.bfloat16, kv_heads=kv_heads, d=d,
                                seed=13)
    for window, softcap in ((None, None), (4096, 30.0)):
        o = decode_triton(q, k, v, cache_len, 1 / math.sqrt(d), window=window, softcap=softcap)
        ref = reference(q, k, v, cache_len, 1 / math.sqrt(d), window, softcap)
        torch.testing.assert_close(o.double(), ref, **TOLERANCE[torch.bfloat16], msg=f"window {window}")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("d", [48, 80, 128, 160, 256])
def test_every_head_dim_and_dtype_fits_on_gpu(d, dtype):
    """The default tiles compile and run at each padded head dim in each dtype (fp32 tiles fit shared memory too)."""
    q, k, v, cache_len = inputs(2, 4, 3000, dtype=dtype, kv_heads=2, d=d, seed=19)
    o = decode_triton(q, k, v, cache_len, 1 / math.sqrt(d))
    torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 1 / math.sqrt(d)), **TOLERANCE[dtype])


@needs_cuda
def test_a_captured_step_reads_the_lengths_it_is_given():
    """Replayed from a CUDA graph, the kernels read cache_len's current values (the split count is shape-only)."""
    q, k, v, cache_len = inputs(4, 4, 5000, dtype=torch.bfloat16, kv_heads=2, d=128, seed=17)
    k, v = k.nan_to_num(), v.nan_to_num()
    decode_triton(q, k, v, cache_len, 0.1)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = decode_triton(q, k, v, cache_len, 0.1)
    for lengths in ([5000, 1, 2500, 4097], [17, 5000, 128, 129]):
        cache_len.copy_(torch.tensor(lengths))
        graph.replay()
        torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.1), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_one_split_writes_the_output_itself(dtype):
    """num_splits=1: the partial kernel writes the output (no partials, no combine), into a strided q's order."""
    q, k, v, cache_len = inputs(2, 4, 500, n_new=2, dtype=dtype, kv_heads=2, d=32, seed=21)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (batch, heads, n_new, d) view of (batch, n_new, heads, d)
    o = decode_triton(q, k, v, cache_len, 0.2, num_splits=1, window=300)
    assert o.stride() == q.stride()
    torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.2, 300), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_seen_signature_runs_its_plan(num_splits):
    """The second call of a signature runs the plan the first kept, on other tensors of that signature; lengths of
    another integer dtype, per (sequence, head) as a transposed view, or for a 3-d q, are read in place."""
    host._plans.clear()
    q, k, v, cache_len = inputs(2, 2, 300, kv_heads=2, d=16, per_head=True, seed=23)
    lens_t = cache_len.to(torch.int32).t().contiguous().t()  # (batch, heads), column-major
    decode_triton(q, k, v, lens_t, 0.25, num_splits=num_splits)
    assert len(host._plans) == 1
    q2, k2, v2, cache_len2 = inputs(2, 2, 300, kv_heads=2, d=16, per_head=True, seed=24)
    lens2 = cache_len2.to(torch.int32).t().contiguous().t()
    o = decode_triton(q2, k2, v2, lens2, 0.25, num_splits=num_splits)
    assert len(host._plans) == 1
    torch.testing.assert_close(o.double(), reference(q2, k2, v2, cache_len2, 0.25), **TOLERANCE[torch.float32])
    q3, k3, v3 = q2[1], k2[1].nan_to_num(), v2[1].nan_to_num()  # (heads, n_new, d), a length per head, then an int
    for lens in (lens2[1], 300):
        for _ in range(2):
            o = decode_triton(q3, k3, v3, lens, 0.25, num_splits=num_splits)
            ref = decode_reference_f64(q3, k3, v3, lens, 0.25)
            torch.testing.assert_close(o.double(), ref, **TOLERANCE[torch.float32])
    assert len(host._plans) == 3


class Lengths(torch.Tensor):
    """A tensor subclass, as a wrapper library might pass the lengths."""


def test_lengths_of_a_tensor_subclass_are_read_on_every_call():
    host._plans.clear()
    for seed in (41, 42):
        q, k, v, cache_len = inputs(2, 2, 300, kv_heads=2, d=16, seed=seed)
        o = decode_triton(q, k, v, cache_len.as_subclass(Lengths), 0.25)
        torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.25), **TOLERANCE[torch.float32])
    assert len(host._plans) == 1


@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1])
def test_plans_launch_the_compiled_kernels_on_gpu(num_splits):
    """On the GPU a plan calls the compiled kernels directly: later calls of a signature on fresh inputs still match."""
    for seed in (31, 32, 33):
        q, k, v, cache_len = inputs(1, 4, 3000, dtype=torch.bfloat16, kv_heads=8, d=128, seed=seed)
        o = decode_triton(q, k, v, cache_len, 0.1, num_splits=num_splits)
        torch.testing.assert_close(o.double(), reference(q, k, v, cache_len, 0.1), **TOLERANCE[torch.bfloat16])
