"""Batches: rows of context_length + 1 tokens drawn by (seed, step), plain or packed by documents.

The data position of a run is its step number: resuming at step s draws exactly the batches an uninterrupted run
would have drawn. A plain row starts anywhere. A packed row (--pack-documents) starts where a document, or a
context-length piece of a long one, starts, and runs on through the next documents, each led by its end-of-document
token (EOD doc0 EOD doc1 ...); with it comes `doc_ids`, each position's document index within the row, which rises
by one at each EOD after the first position (attention then stays within each document, RoPE restarts at each).
Under DDP/FSDP every rank draws the same global batch and takes its contiguous slice of the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from training.data.source import DataError, DataSource


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (rows, seq) int64
    targets: torch.Tensor  # (rows, seq) int64: the inputs shifted by one
    doc_ids: Optional[torch.Tensor] = None  # (rows, seq) int64 when packed


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


def _row_starts(tokens: np.ndarray, batch_size: int, context_length: int, seed: int, step: int) -> np.ndarray:
    if len(tokens) <= context_length:
        raise DataError(f"{len(tokens)} tokens cannot fill one row of context length {context_length} plus one")
    return np.random.default_rng((seed, step)).integers(0, len(tokens) - context_length, size=batch_size)


def _to_device(rows: np.ndarray, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(rows)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def batch_at(tokens: np.ndarray, batch_size: int, context_length: int, seed: int, step: int, rank: int = 0,
             world_size: int = 1, device: torch.device | str = "cpu", doc_starts: Optional[np.ndarray] = None,
             eod_id: Optional[int] = None) -> Batch:
    """The global batch of `step` (batch_size rows), drawn by (seed, step); rank r gets its contiguous slice of
    batch_size // world_size rows. Packed when doc_starts and eod_id are given."""
    if batch_size % world_size:
        raise ValueError(f"global batch {batch_size} is not divisible by world size {world_size}")
    starts = _row_starts(tokens, batch_size, context_length, seed, step)
    if doc_starts is not None:
        starts = piece_starts(starts, np.asarray(doc_starts), context_length)
    per_rank = batch_size // world_size
    mine = starts[rank * per_rank:(rank + 1) * per_rank]
    window = np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in mine])
    if doc_starts is None:
        rows = _to_device(window, device)
        return Batch(rows[:, :-1], rows[:, 1:])
    # One copy to the device for the tokens and their document ids together.
    both = _to_device(np.concatenate([window, document_ids(window[:, :-1], eod_id)], axis=1), device)
    rows, ids = both[:, :context_length + 1], both[:, context_length + 1:]
    return Batch(rows[:, :-1], rows[:, 1:], ids)


@dataclass(frozen=True)
class Sampler:
    """A run's batches from its data source: `train(step)` for the loop, `val()` for evaluation."""

    source: DataSource
    batch_size: int  # global
    context_length: int
    seed: int
    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"
    packed: bool = False

    def __post_init__(self) -> None:
        if self.packed and not self.source.has_documents:
            raise DataError(f"--pack-documents needs prepared data (prepare_data.py, then --data DIR); "
                            f"{self.source.description} has no document boundaries")

    def train(self, step: int) -> Batch:
        docs = self.source.doc_starts["train"] if self.packed else None
        return batch_at(self.source.train, self.batch_size, self.context_length, self.seed, step, self.rank,
                        self.world_size, self.device, docs, self.source.eod_id)

    def val(self, n_batches: int, split: str = "val") -> Iterator[Batch]:
        """The fixed evaluation batches of a run: drawn by (seed, index), not by step, so that every evaluation of
        the run (and evaluate.py) sees the same rows."""
        tokens = self.source.split(split)
        for i in range(n_batches):
            yield batch_at(tokens, self.batch_size, self.context_length, self.seed, i, self.rank, self.world_size,
                           self.device)


def sequential_batches(tokens: np.ndarray, batch_size: int, context_length: int,
                       device: torch.device | str = "cpu") -> Iterator[Batch]:
    """Every token of `tokens` once as a target (but the first): consecutive windows, the last one shorter."""
    n = len(tokens) - 1
    starts = list(range(0, n, context_length))
    for i in range(0, len(starts), batch_size):
        rows = starts[i:i + batch_size]
        full = [s for s in rows if s + context_length <= n]
        if full:
            w = _to_device(np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in full]),
                           device)
            yield Batch(w[:, :-1], w[:, 1:])
        for s in rows[len(full):]:  # the tail window, shorter than the context
            w = _to_device(np.asarray(tokens[s:n + 1], dtype=np.int64)[None], device)
            yield Batch(w[:, :-1], w[:, 1:])
