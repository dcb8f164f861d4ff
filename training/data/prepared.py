"""Prepared data: a directory of token files that prepare_data.py writes and train.py / evaluate.py read.

    <dir>/meta.json            dtype, vocabulary, tokenizer, and per split its tokens, bytes and documents
    <dir>/tokenizer.json       the BPE tokenizer (Hugging Face format; none for the bytes tokenizer)
    <dir>/train.bin, val.bin   token ids, uint16 when the vocabulary fits, else uint32, no header
    <dir>/train_docs.npy, val_docs.npy   the position of every document's first token (int64)

Every document begins with the end-of-document token (a separator, as GPT-2's <|endoftext|>), so the stream reads
EOD doc0 EOD doc1 ... and a document's tokens run from its start to the next one's. The byte count of a split is
that of the UTF-8 text it encodes plus one per end-of-document token (the separator it stands for): bits per byte
are then loss_nats * tokens / (ln 2 * bytes), comparable across tokenizers.

prepare.py writes it. `open_prepared` opens one as a DataSource (memory-mapped), checking its files against meta.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from training.data.source import DataError, DataSource
from training.data.tokenizer import Tokenizer, load_tokenizer

FORMAT = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")


class PreparedDataError(DataError):
    """A prepared directory that cannot be read or written; the one-line message names the problem."""


def split_paths(directory: Path, split: str) -> tuple[Path, Path]:
    """A split's token file and its document starts."""
    return directory / f"{split}.bin", directory / f"{split}_docs.npy"


def read_meta(directory: Path) -> Optional[dict]:
    path = directory / META_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"{path} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class PreparedSplit:
    tokens: np.ndarray  # read-only memmap
    doc_starts: np.ndarray  # int64 position of every document's first token (its end-of-document token)
    bytes: int  # UTF-8 bytes of the text it encodes, one per end-of-document token included


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    meta: dict
    splits: dict[str, PreparedSplit] = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.meta["eod_id"])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"], self.directory)

    def describe(self) -> str:
        return f"{self.meta['tokenizer']} tokens of {self.meta['source']}, prepared in {self.directory}"


def is_prepared(path: Path) -> bool:
    """A directory prepare_data.py wrote, or one that looks like it (token files without meta.json)."""
    return path.is_dir() and ((path / META_FILE).exists() or (path / "train.bin").exists())


def load_prepared(directory: Path) -> PreparedData:
    """Open a prepared directory (memory-mapped), checking its files against meta.json."""
    meta = read_meta(directory)
    if meta is None:
        raise PreparedDataError(f"{directory} holds token files but no {META_FILE} beside them (dtype, vocabulary and "
                                "tokenizer are unknown); prepare the directory with prepare_data.py")
    if meta.get("format") != FORMAT:
        raise PreparedDataError(f"{directory / META_FILE} has format {meta.get('format')}, this code reads {FORMAT}; "
                                "prepare the data again")
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for split in SPLITS:
        bin_path, docs_path = split_paths(directory, split)
        counts = meta["splits"][split]
        for p in (bin_path, docs_path):
            if not p.exists():
                raise PreparedDataError(f"{directory} lacks {p.name}, which {META_FILE} lists; prepare it again")
        if bin_path.stat().st_size != counts["tokens"] * dtype.itemsize:
            raise PreparedDataError(f"{bin_path} holds {bin_path.stat().st_size} bytes, but {META_FILE} says "
                                    f"{counts['tokens']} {dtype.name} tokens; prepare it again")
        splits[split] = PreparedSplit(np.memmap(bin_path, dtype=dtype, mode="r"), np.load(docs_path),
                                      int(counts["bytes"]))
    return PreparedData(directory, meta, splits)


def open_prepared(directory: Path, context_length: int) -> DataSource:
    """A prepared directory as a DataSource; each split must hold a context window plus one token."""
    data = load_prepared(directory)
    train, val = data.splits["train"].tokens, data.splits["val"].tokens
    for name, tokens in (("train", train), ("val", val)):
        if len(tokens) < context_length + 1:
            raise PreparedDataError(f"the {name} split of {directory} has {len(tokens)} tokens, fewer than one window "
                                    f"of context length {context_length} plus one")
    tokenizer = data.tokenizer()
    meta = data.meta
    identity = {"kind": "prepared", "source": str(directory), "corpus": meta["source"],
                "fingerprint": f"prepared:{meta.get('key')}", "tokenizer": meta["tokenizer"],
                "tokenizer_fingerprint": meta["tokenizer_fingerprint"], "vocab_size": meta["vocab_size"],
                "eod_id": meta["eod_id"]}
    return DataSource(train, val, data.describe(), data.vocab_size, tokenizer.token_bytes(),
                      {s: data.splits[s].doc_starts for s in SPLITS}, data.eod_id, tokenizer, identity)
