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

from training.data.source import DataError, DataSource, content_crc
from training.data.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError, load_tokenizer, token_dtype

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
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise PreparedDataError(f"{path} does not hold an object of settings and counts; prepare the data again")
    return meta


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


_META_SCHEMA = {"format": int, "key": str, "source": str, "tokenizer": str, "tokenizer_fingerprint": str,
                "vocab_size": int, "eod_id": int, "dtype": str, "splits": dict}
_SPLIT_SCHEMA = ("tokens", "bytes", "documents")


def check_meta(directory: Path, meta: dict) -> None:
    """meta.json against its schema: every key of the right type, a dtype that holds the vocabulary, both splits."""
    where = directory / META_FILE
    if meta.get("format") != FORMAT:
        raise PreparedDataError(f"{where} has format {meta.get('format')}, this code reads {FORMAT}; prepare the data "
                                "again")
    for key, kind in _META_SCHEMA.items():
        if not isinstance(meta.get(key), kind):
            raise PreparedDataError(f"{where} lacks {key!r} or it is not a {kind.__name__}; prepare the data again")
    if meta["dtype"] not in ("uint16", "uint32") or np.dtype(meta["dtype"]) != token_dtype(meta["vocab_size"]):
        raise PreparedDataError(f"{where} says dtype {meta['dtype']!r}, but a vocabulary of {meta['vocab_size']} is "
                                f"stored as {token_dtype(meta['vocab_size']).name}; prepare the data again")
    if not 0 <= meta["eod_id"] < meta["vocab_size"]:
        raise PreparedDataError(f"{where}: eod_id {meta['eod_id']} is outside the vocabulary of {meta['vocab_size']}")
    for split in SPLITS:
        counts = meta["splits"].get(split)
        if not isinstance(counts, dict) or any(not isinstance(counts.get(k), int) for k in _SPLIT_SCHEMA):
            raise PreparedDataError(f"{where} lacks the {split} split's {', '.join(_SPLIT_SCHEMA)}; prepare the data "
                                    "again")


def _check_split(directory: Path, meta: dict, split: str, tokens: np.ndarray, doc_starts: np.ndarray) -> None:
    """A split's files against meta.json: their sizes, and the checksum written with the tokens."""
    counts = meta["splits"][split]
    bin_path = split_paths(directory, split)[0]
    if len(tokens) != counts["tokens"]:
        raise PreparedDataError(f"{bin_path} holds {bin_path.stat().st_size} bytes, but {META_FILE} says "
                                f"{counts['tokens']} {meta['dtype']} tokens; prepare it again")
    if len(doc_starts) != counts["documents"]:
        raise PreparedDataError(f"{split_paths(directory, split)[1]} lists {len(doc_starts)} documents, "
                                f"{META_FILE} {counts['documents']}; prepare it again")
    expected = meta.get("checksums", {}).get(split)
    if expected is not None and content_crc(tokens) != expected:
        raise PreparedDataError(f"{bin_path} does not match the checksum written with it (the file is damaged or "
                                "was replaced); prepare it again")


def _check_tokenizer(directory: Path, meta: dict, tokenizer: Tokenizer) -> None:
    if tokenizer.fingerprint() != meta["tokenizer_fingerprint"] or tokenizer.vocab_size != meta["vocab_size"]:
        raise PreparedDataError(f"{directory / TOKENIZER_FILE} is not the tokenizer {META_FILE} records (fingerprint "
                                f"{tokenizer.fingerprint()}, vocabulary {tokenizer.vocab_size}; recorded "
                                f"{meta['tokenizer_fingerprint']}, {meta['vocab_size']}); prepare the data again")


def load_prepared(directory: Path) -> PreparedData:
    """Open a prepared directory (memory-mapped), checked against meta.json: its schema, the files' sizes and
    checksums, and the tokenizer's fingerprint and vocabulary."""
    meta = read_meta(directory)
    if meta is None:
        raise PreparedDataError(f"{directory} holds token files but no {META_FILE} beside them (dtype, vocabulary and "
                                "tokenizer are unknown); prepare the directory with prepare_data.py")
    check_meta(directory, meta)
    splits = {}
    for split in SPLITS:
        bin_path, docs_path = split_paths(directory, split)
        for p in (bin_path, docs_path):
            if not p.exists():
                raise PreparedDataError(f"{directory} lacks {p.name}, which {META_FILE} lists; prepare it again")
        if bin_path.stat().st_size % np.dtype(meta["dtype"]).itemsize:
            raise PreparedDataError(f"{bin_path} holds {bin_path.stat().st_size} bytes, not a whole number of "
                                    f"{meta['dtype']} tokens; prepare it again")
        tokens = np.memmap(bin_path, dtype=meta["dtype"], mode="r")
        doc_starts = np.load(docs_path, allow_pickle=False)
        _check_split(directory, meta, split, tokens, doc_starts)
        splits[split] = PreparedSplit(tokens, doc_starts, int(meta["splits"][split]["bytes"]))
    data = PreparedData(directory, meta, splits)
    try:
        tokenizer = data.tokenizer()
    except TokenizerError as e:
        raise PreparedDataError(f"{directory}: {e}") from None
    _check_tokenizer(directory, meta, tokenizer)
    return data


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
