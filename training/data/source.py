"""A data source: the training and validation token streams of one --data, whatever its kind, and what they encode.

Each kind of --data has a module that opens it as a DataSource (text.py: the built-in corpus, text files and
directories as bytes; tokens.py: token files; prepared.py: prepare_data.py's directories; synthetic.py); the loop
draws its batches through training/data/sampling.py and never asks which kind it has.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


class DataError(ValueError):
    """Data that cannot be trained or evaluated on; the one-line message names the file or flag and the problem."""


@dataclass(frozen=True)
class DataSource:
    train: np.ndarray  # 1-d token ids (often a read-only memmap)
    val: np.ndarray
    description: str
    vocab_size: Optional[int]  # None: the data does not say (token files)
    token_bytes: Optional[np.ndarray] = None  # bytes of text per token id, for bits per byte; None: unknown
    doc_starts: Optional[dict[str, np.ndarray]] = field(default=None, repr=False)  # per split, where documents start
    eod_id: Optional[int] = None  # the end-of-document token that begins every document
    tokenizer: Any = None  # training.data.tokenizer's, for prepared data
    identity: dict[str, Any] = field(default_factory=dict)  # what a run records about its data

    @property
    def has_documents(self) -> bool:
        return self.doc_starts is not None and self.eod_id is not None

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "val"):
            raise ValueError(f"unknown split {name!r}; valid: train, val")
        return self.train if name == "train" else self.val


def content_crc(tokens: np.ndarray, block: int = 1 << 24) -> str:
    """A CRC-32 of a token stream's bytes (read in blocks, whatever its size): what a run records of its data."""
    crc = 0
    flat = np.asarray(tokens).reshape(-1)
    for start in range(0, len(flat), block):
        crc = zlib.crc32(np.ascontiguousarray(flat[start:start + block]).view(np.uint8), crc)
    return f"crc32:{crc:08x}:{len(flat)}"


def split_train_val(tokens: np.ndarray, context_length: int, val_fraction: float = 0.05,
                    name: str = "the corpus") -> tuple[np.ndarray, np.ndarray]:
    """The last `val_fraction` of the stream is held out; both parts must hold one context window plus one token."""
    need = context_length + 1
    n_val = max(int(len(tokens) * val_fraction), need)
    if len(tokens) - n_val < need:
        raise DataError(f"{name} has {len(tokens)} tokens, too short for a training and a validation window of "
                        f"context length {context_length} (needs at least {2 * need})")
    return tokens[:-n_val], tokens[-n_val:]


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str = "the data") -> None:
    """Every token id must index the embedding: 0 <= id < vocab_size."""
    if len(tokens) == 0:
        raise DataError(f"{source} holds no tokens")
    if np.issubdtype(tokens.dtype, np.signedinteger):
        low = int(tokens.min())
        if low < 0:
            where = int(np.argmax(np.asarray(tokens) < 0))
            raise DataError(f"{source} holds token id {low} (the first negative one at position {where:,}); ids "
                            f"must be in [0, {vocab_size})")
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{source} holds token id {top}, but the model's vocabulary is {vocab_size}; pass "
                        f"--vocab-size {top + 1} or more")
