"""Packed documents: batches whose rows begin where a document begins, with the document id of every position.

In a prepared stream every document begins with the end-of-document token (EOD doc0 EOD doc1 ...). A packed row
starts at the beginning of a document and runs on through the documents that follow it, each still led by its
EOD, until the row is full; the last one is cut there. A document longer than the context is read in
context-length pieces, each of which can begin a row, so long documents are covered to their end, not only their
first context's worth. With every batch comes `doc_ids` (batch, seq): for each input position the index of its
document within the row, which rises by one exactly at each EOD after the first position (a document mask lets
position i attend to j only where the two ids are equal).

Row starts are drawn as training.data.batch_at draws them, by (seed, step), and then moved back to the start of
their piece: the batches of a step are a function of the step alone, so a resumed run draws exactly the batches an
uninterrupted one would have.
"""

from __future__ import annotations

import numpy as np
import torch


def document_ids(inputs: np.ndarray, eod_id: int) -> np.ndarray:
    """(rows, seq) -> the index of each position's document within its row (int64, 0 at the first position)."""
    boundary = inputs == eod_id
    boundary[:, 0] = False  # a row that starts with EOD starts with document 0
    return np.cumsum(boundary, axis=1)


def piece_starts(positions: np.ndarray, doc_starts: np.ndarray, context_length: int) -> np.ndarray:
    """The start of the context-length piece of its document that each position falls in."""
    k = np.searchsorted(doc_starts, positions, side="right") - 1
    first = np.where(k >= 0, doc_starts[np.maximum(k, 0)], 0)  # text before the first EOD counts as a document
    return first + (positions - first) // context_length * context_length


def packed_batch_at(tokens: np.ndarray, doc_starts: np.ndarray, eod_id: int, batch_size: int, context_length: int,
                    seed: int, step: int, rank: int = 0, world_size: int = 1,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global packed batch of `step`; rank r gets its contiguous slice of the rows.

    Returns (inputs, targets, doc_ids), each (batch_size // world_size, context_length) int64.
    """
    if batch_size % world_size:
        raise ValueError(f"global batch {batch_size} is not divisible by world size {world_size}")
    if len(tokens) <= context_length:
        raise ValueError(f"{len(tokens)} tokens cannot fill one row of context length {context_length} plus one")
    positions = np.random.default_rng((seed, step)).integers(0, len(tokens) - context_length, size=batch_size)
    starts = piece_starts(positions, np.asarray(doc_starts), context_length)
    per_rank = batch_size // world_size
    mine = starts[rank * per_rank:(rank + 1) * per_rank]
    window = np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in mine])
    ids = document_ids(window[:, :-1], eod_id)
    both = torch.from_numpy(np.concatenate([window, ids], axis=1))
    if torch.device(device).type == "cuda":
        both = both.pin_memory().to(device, non_blocking=True)
    else:
        both = both.to(device)
    window, ids = both[:, :context_length + 1], both[:, context_length + 1:]
    return window[:, :-1], window[:, 1:], ids
