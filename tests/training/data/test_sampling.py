"""training/data/sampling.py: batches drawn by (seed, step), plain or packed by documents, and the Sampler."""

import numpy as np
import pytest
import torch

from training.data import DataError, DataSource
from training.data.sampling import Batch, Sampler, batch_at, document_ids, piece_starts, sequential_batches

EOD = 0


def stream(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """EOD doc0 EOD doc1 ...: documents of the given lengths (EOD included) with tokens 1..99."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[EOD], rng.integers(1, 100, n - 1)]) for n in lengths]
    starts = np.cumsum([0] + lengths[:-1])
    return np.concatenate(docs).astype(np.uint16), starts


def old_packed_batch_at(tokens, doc_starts, eod_id, batch_size, context_length, seed, step, rank=0, world_size=1):
    """training/packing.py's packed_batch_at as it was before batch_at took it over (its code, on the CPU)."""
    positions = np.random.default_rng((seed, step)).integers(0, len(tokens) - context_length, size=batch_size)
    k = np.searchsorted(doc_starts, positions, side="right") - 1
    first = np.where(k >= 0, doc_starts[np.maximum(k, 0)], 0)
    starts = first + (positions - first) // context_length * context_length
    per_rank = batch_size // world_size
    mine = starts[rank * per_rank:(rank + 1) * per_rank]
    window = np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in mine])
    boundary = window[:, :-1] == eod_id
    boundary[:, 0] = False
    ids = np.cumsum(boundary, axis=1)
    window = torch.from_numpy(window)
    return window[:, :-1], window[:, 1:], torch.from_numpy(ids)


# ------------------------------------------------------------------------------------------------ plain rows


def test_batches_are_shifted_deterministic_and_split_across_ranks():
    tokens = np.arange(10_000) % 997
    batch = batch_at(tokens, 8, 16, seed=3, step=5)
    x, y = batch.inputs, batch.targets
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64 and batch.doc_ids is None
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    torch.testing.assert_close(x, batch_at(tokens, 8, 16, seed=3, step=5).inputs)
    assert not torch.equal(x, batch_at(tokens, 8, 16, seed=3, step=6).inputs)
    assert not torch.equal(x, batch_at(tokens, 8, 16, seed=4, step=5).inputs)
    halves = [batch_at(tokens, 8, 16, seed=3, step=5, rank=r, world_size=2) for r in (0, 1)]
    torch.testing.assert_close(torch.cat([h.inputs for h in halves]), x)
    torch.testing.assert_close(torch.cat([h.targets for h in halves]), y)
    with pytest.raises(ValueError, match="global batch 8 is not divisible by world size 3"):
        batch_at(tokens, 8, 16, seed=3, step=5, world_size=3)
    with pytest.raises(DataError, match="^16 tokens cannot fill one row of context length 16 plus one$"):
        batch_at(tokens[:16], 2, 16, seed=3, step=5)


def test_sequential_batches_score_every_token_once():
    tokens = np.arange(103)
    batches = list(sequential_batches(tokens, batch_size=3, context_length=10))
    assert all(isinstance(b, Batch) and b.doc_ids is None for b in batches)
    targets = torch.cat([b.targets.flatten() for b in batches])
    np.testing.assert_array_equal(targets.numpy(), np.arange(1, 103))
    for b in batches:
        torch.testing.assert_close(b.inputs + 1, b.targets)
    assert [tuple(b.inputs.shape) for b in batches] == [(3, 10)] * 3 + [(1, 10), (1, 2)]


# ------------------------------------------------------------------------------------------------ packed rows


def test_document_ids_rise_at_each_end_of_document_token():
    rows = np.array([[EOD, 5, 6, EOD, 7, EOD, EOD, 8],
                     [4, 5, EOD, 6, 7, 8, 9, 1]])
    np.testing.assert_array_equal(document_ids(rows, EOD), [[0, 0, 0, 1, 1, 2, 3, 3],
                                                            [0, 0, 1, 1, 1, 1, 1, 1]])


def test_rows_begin_at_documents_or_context_pieces_of_long_ones():
    tokens, starts = stream([5, 40, 3, 100, 7] * 20)
    positions = np.arange(len(tokens) - 16)
    begins = piece_starts(positions, starts, 16)
    allowed = {int(s + k * 16) for s, n in zip(starts, [5, 40, 3, 100, 7] * 20) for k in range(-(-n // 16))}
    assert set(begins.tolist()) <= allowed and (begins <= positions).all() and (positions - begins < 16).all()
    # Every piece of a long document can begin a row: it is read to its end, not just its first context.
    assert {int(starts[3]) + 96} <= set(begins.tolist())


def test_packed_batches_line_up_and_repeat_by_step():
    lengths = list(np.random.default_rng(1).integers(2, 60, 300))
    tokens, starts = stream(lengths)
    batch = batch_at(tokens, 8, 32, seed=3, step=11, doc_starts=starts, eod_id=EOD)
    x, y, ids = batch.inputs, batch.targets, batch.doc_ids
    assert x.shape == y.shape == ids.shape == (8, 32) and x.dtype == ids.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    boundary = (x == EOD)
    boundary[:, 0] = False
    assert torch.equal(ids[:, 1:] - ids[:, :-1], boundary[:, 1:].long()), "ids rise by one exactly at each EOD"
    assert (ids[:, 0] == 0).all()
    short_first = [int(tokens[s]) == EOD for s in piece_starts(
        np.random.default_rng((3, 11)).integers(0, len(tokens) - 32, size=8), starts, 32)]
    assert torch.equal(x[:, 0] == EOD, torch.tensor(short_first)), "a row starts where a document (piece) starts"

    # Resume: the batches of a step depend on (seed, step) only, and the ranks' slices make up the global batch.
    again = batch_at(tokens, 8, 32, seed=3, step=11, doc_starts=starts, eod_id=EOD)
    for a, b in zip((x, y, ids), (again.inputs, again.targets, again.doc_ids)):
        assert torch.equal(a, b)
    assert not torch.equal(x, batch_at(tokens, 8, 32, seed=3, step=12, doc_starts=starts, eod_id=EOD).inputs)
    halves = [batch_at(tokens, 8, 32, seed=3, step=11, rank=r, world_size=2, doc_starts=starts, eod_id=EOD)
              for r in (0, 1)]
    for field, whole in (("inputs", x), ("targets", y), ("doc_ids", ids)):
        assert torch.equal(torch.cat([getattr(h, field) for h in halves]), whole)


def test_packed_rows_are_bitwise_those_of_the_old_packed_batch_at():
    lengths = list(np.random.default_rng(2).integers(2, 90, 400))
    tokens, starts = stream(lengths, seed=2)
    for seed, step, rank, world_size in ((0, 0, 0, 1), (3, 11, 0, 1), (7, 123, 1, 2), (7, 123, 3, 4)):
        new = batch_at(tokens, 8, 32, seed, step, rank, world_size, doc_starts=starts, eod_id=EOD)
        old = old_packed_batch_at(tokens, starts, EOD, 8, 32, seed, step, rank, world_size)
        for a, b in zip((new.inputs, new.targets, new.doc_ids), old):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_packed_batch_errors():
    tokens, starts = stream([10, 10])
    with pytest.raises(ValueError, match="global batch 8 is not divisible by world size 3"):
        batch_at(tokens, 8, 4, seed=0, step=0, world_size=3, doc_starts=starts, eod_id=EOD)
    with pytest.raises(DataError, match="20 tokens cannot fill one row of context length 32"):
        batch_at(tokens, 2, 32, seed=0, step=0, doc_starts=starts, eod_id=EOD)


# ------------------------------------------------------------------------------------------------ the Sampler


@pytest.fixture(scope="module")
def documents() -> DataSource:
    """A source with documents in both splits, as prepared data has."""
    train, train_starts = stream(list(np.random.default_rng(3).integers(2, 60, 300)), seed=3)
    val, val_starts = stream(list(np.random.default_rng(4).integers(2, 60, 50)), seed=4)
    return DataSource(train, val, "documents", 100, np.ones(100, dtype=np.int64),
                      {"train": train_starts, "val": val_starts}, EOD)


def batches_equal(a: Batch, b: Batch) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((a.inputs, b.inputs), (a.targets, b.targets), (a.doc_ids, b.doc_ids)))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_train_batches_are_a_function_of_seed_and_step(documents, packed):
    def sampler(**kw) -> Sampler:
        return Sampler(documents, batch_size=8, context_length=32, seed=5, packed=packed, **kw)

    first = sampler().train(17)
    assert (first.doc_ids is not None) == packed and first.inputs.shape == (8, 32)
    assert batches_equal(sampler().train(17), first), "a new sampler (a resumed run) draws the same batch"
    assert not batches_equal(sampler().train(18), first)
    assert not batches_equal(Sampler(documents, 8, 32, seed=6, packed=packed).train(17), first)
    expected = batch_at(documents.train, 8, 32, 5, 17, doc_starts=documents.doc_starts["train"] if packed else None,
                        eod_id=EOD)
    assert batches_equal(first, expected)
    for world_size in (2, 4):
        parts = [sampler(rank=r, world_size=world_size).train(17) for r in range(world_size)]
        assert all(p.inputs.shape == (8 // world_size, 32) for p in parts)
        whole = Batch(*(None if getattr(first, f) is None else torch.cat([getattr(p, f) for p in parts])
                        for f in ("inputs", "targets", "doc_ids")))
        assert batches_equal(whole, first), "the ranks' slices concatenate to the global batch"


def test_packed_sampler_needs_documents(documents):
    plain = DataSource(documents.train, documents.val, "uint16 token file t.bin", None)
    with pytest.raises(DataError) as e:
        Sampler(plain, 8, 32, seed=0, packed=True)
    assert str(e.value) == ("--pack-documents needs prepared data (prepare_data.py, then --data DIR); uint16 token "
                            "file t.bin has no document boundaries")
    assert Sampler(plain, 8, 32, seed=0).train(0).doc_ids is None


def test_validation_batches_are_the_same_every_call(documents):
    sampler = Sampler(documents, 4, 16, seed=7)
    first, again = list(sampler.val(3)), list(sampler.val(3))
    assert len(first) == 3 and all(batches_equal(a, b) for a, b in zip(first, again))
    assert not batches_equal(first[0], first[1])
    # Drawn from the validation split by (seed, index), whatever training step the run is at.
    for i, batch in enumerate(first):
        assert batches_equal(batch, batch_at(documents.val, 4, 16, 7, i))
    assert batches_equal(next(sampler.val(1, "train")), batch_at(documents.train, 4, 16, 7, 0))
    halves = [list(Sampler(documents, 4, 16, seed=7, rank=r, world_size=2).val(3)) for r in (0, 1)]
    for i, batch in enumerate(first):
        assert torch.equal(torch.cat([halves[0][i].inputs, halves[1][i].inputs]), batch.inputs)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        next(sampler.val(1, "test"))
