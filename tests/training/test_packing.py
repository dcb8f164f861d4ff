import numpy as np
import pytest
import torch

from training.packing import document_ids, packed_batch_at, piece_starts

EOD = 0


def stream(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """EOD doc0 EOD doc1 ...: documents of the given lengths (EOD included) with tokens 1..99."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[EOD], rng.integers(1, 100, n - 1)]) for n in lengths]
    starts = np.cumsum([0] + lengths[:-1])
    return np.concatenate(docs).astype(np.uint16), starts


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
    x, y, ids = packed_batch_at(tokens, starts, EOD, 8, 32, seed=3, step=11)
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
    for a, b in zip((x, y, ids), packed_batch_at(tokens, starts, EOD, 8, 32, seed=3, step=11)):
        assert torch.equal(a, b)
    assert not torch.equal(x, packed_batch_at(tokens, starts, EOD, 8, 32, seed=3, step=12)[0])
    halves = [packed_batch_at(tokens, starts, EOD, 8, 32, seed=3, step=11, rank=r, world_size=2) for r in (0, 1)]
    for i, whole in enumerate((x, y, ids)):
        assert torch.equal(torch.cat([h[i] for h in halves]), whole)


def test_packed_batch_errors():
    tokens, starts = stream([10, 10])
    with pytest.raises(ValueError, match="global batch 8 is not divisible by world size 3"):
        packed_batch_at(tokens, starts, EOD, 8, 4, seed=0, step=0, world_size=3)
    with pytest.raises(ValueError, match="20 tokens cannot fill one row of context length 32"):
        packed_batch_at(tokens, starts, EOD, 2, 32, seed=0, step=0)
