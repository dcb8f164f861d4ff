"""Prepared data: a directory of token files that prepare_data.py writes and train.py / evaluate.py read.

    <dir>/meta.json            dtype, vocabulary, tokenizer, and per split its tokens, bytes and documents
    <dir>/tokenizer.json       the BPE tokenizer (Hugging Face format; none for the bytes tokenizer)
    <dir>/train.bin, val.bin   token ids, uint16 when the vocabulary fits, else uint32, no header
    <dir>/train_docs.npy, val_docs.npy   the position of every document's first token (int64)

Every document begins with the end-of-document token (a separator, as GPT-2's <|endoftext|>), so the stream reads
EOD doc0 EOD doc1 ... and a document's tokens run from its start to the next one's. The byte count of a split is
that of the UTF-8 text it encodes plus one per end-of-document token (the separator it stands for): bits per byte
are then loss_nats * tokens / (ln 2 * bytes), comparable across tokenizers.

Preparing is keyed by a content hash of the input and the settings: a second run on the same input finds the result
and returns at once. The directory is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import tokenizers
from tqdm import tqdm

from training.files import fsync_dir, temp_path
from training.text_corpus import Segment, TextCorpus, content_hash, documents, split_segments
from training.tokenizer import (BPETokenizer, ByteTokenizer, Tokenizer, check_vocab_size, load_tokenizer,
                                token_dtype)

FORMAT = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
PIECE_CHARS = 1 << 20  # longest text handed to the encoder at once
BATCH_CHARS = 2 << 20  # text per parallel encode call: bounds the memory of a batch of pieces and their tokens


class PreparedDataError(ValueError):
    """A prepared directory that cannot be read or written; the one-line message names the problem."""


@dataclass(frozen=True)
class Settings:
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    separator: str = "<|endoftext|>"
    val_fraction: float = 0.05
    tokenizer_sample_bytes: int = 256 << 20  # BPE is trained on at most this much of the training split

    def check(self) -> None:
        check_vocab_size(self.tokenizer, self.vocab_size)
        if not 0 < self.val_fraction < 1:
            raise PreparedDataError(f"--val-fraction {self.val_fraction} must lie strictly between 0 and 1")
        if self.tokenizer_sample_bytes < 1:
            raise PreparedDataError(f"--tokenizer-sample-bytes must be >= 1, got {self.tokenizer_sample_bytes}")

    def key_text(self) -> str:
        """What the prepared tokens depend on besides the input (the library's version: its BPE trainer)."""
        return json.dumps({"format": FORMAT, "tokenizers": tokenizers.__version__, **self.__dict__}, sort_keys=True)


def _paths(directory: Path, split: str) -> tuple[Path, Path]:
    return directory / f"{split}.bin", directory / f"{split}_docs.npy"


def _tokenizer_texts(segments: list[Segment], settings: Settings, train_bytes: int) -> Iterator[str]:
    """The training split's text, or an evenly spread sample of it when it exceeds tokenizer_sample_bytes."""
    ratio = min(1.0, settings.tokenizer_sample_bytes / max(train_bytes, 1))
    seen = kept = 0
    with tqdm(total=train_bytes, unit="B", unit_scale=True, desc="train tokenizer", disable=None) as bar:
        for seg in segments:
            if seg.split != "train":
                continue
            for text, _ in documents(seg, settings.separator, PIECE_CHARS, bar):
                n = len(text)
                if kept <= seen * ratio:  # keeps the running share of text at `ratio`
                    kept += n
                    yield text
                seen += n


class _SplitWriter:
    """Appends one split's tokens to its .bin and collects its document starts and counts."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, eod_id: int):
        self.bin_path, self.docs_path = _paths(directory, split)
        self.file = open(self.bin_path, "wb")
        self.dtype, self.eod = dtype, np.array([eod_id], dtype=dtype)
        self.tokens = self.bytes = 0
        self.doc_starts: list[int] = []

    def write(self, ids: np.ndarray, n_bytes: int, starts_document: bool) -> None:
        if starts_document:
            self.doc_starts.append(self.tokens)
            self.file.write(self.eod.tobytes())
            self.tokens += 1
            self.bytes += 1
        self.file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)
        self.bytes += n_bytes

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        np.save(self.docs_path, np.asarray(self.doc_starts, dtype=np.int64))
        return {"tokens": self.tokens, "bytes": self.bytes, "documents": len(self.doc_starts)}


def _encode(segments: list[Segment], tokenizer: Tokenizer, settings: Settings, directory: Path,
            total_bytes: int) -> dict[str, dict]:
    """Encode every segment's documents into its split's files, in parallel batches of about BATCH_CHARS."""
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _SplitWriter(directory, s, dtype, tokenizer.eod_id) for s in SPLITS}
    batch: list[tuple[str, bool, str]] = []

    def flush() -> None:
        for (text, starts, split), ids in zip(batch, tokenizer.encode_batch([t for t, _, _ in batch])):
            writers[split].write(ids, len(text.encode("utf-8")), starts)
        batch.clear()

    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode", disable=None) as bar:
        size = 0
        for seg in segments:
            for text, starts in documents(seg, settings.separator, PIECE_CHARS, bar):
                batch.append((text, starts, seg.split))
                size += len(text)
                if size >= BATCH_CHARS:
                    flush()
                    size = 0
        flush()
    return {s: w.close() for s, w in writers.items()}


def read_meta(directory: Path) -> Optional[dict]:
    path = directory / META_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"{path} is not valid JSON: {e}") from None


def prepare(corpus: TextCorpus, out: Path, settings: Settings = Settings()) -> tuple[dict, bool]:
    """Tokenize `corpus` into the prepared directory `out`; returns (its meta, whether an earlier result was reused).

    An existing `out` prepared from the same content with the same settings is reused as it is; one from other
    content is replaced (atomically); any other existing non-empty directory is left alone and refused.
    """
    settings.check()
    key = content_hash(corpus, settings.key_text())
    if out.exists():
        meta = read_meta(out) if out.is_dir() else None
        if meta is not None and meta.get("key") == key:
            return meta, True
        if meta is None and (not out.is_dir() or any(out.iterdir())):
            raise PreparedDataError(f"--out {out} exists and is not a prepared data directory (no {META_FILE}); "
                                    "choose another --out")
    segments = split_segments(corpus, settings.val_fraction)
    total = sum(s.end - s.start for s in segments)
    if total == 0:
        raise PreparedDataError(f"the corpus is empty: {corpus.description}")
    if not any(s.split == "val" for s in segments):
        raise PreparedDataError(f"the corpus is too short to hold out {settings.val_fraction:.0%} for validation "
                                f"(its last line is longer than that): {corpus.description}")
    train_bytes = sum(s.end - s.start for s in segments if s.split == "train")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        if settings.tokenizer == "bytes":
            tokenizer: Tokenizer = ByteTokenizer()
        else:
            tokenizer = BPETokenizer.train(_tokenizer_texts(segments, settings, train_bytes), settings.vocab_size)
        tokenizer.save(tmp)
        splits = _encode(segments, tokenizer, settings, tmp, total)
        for split, counts in splits.items():
            if counts["tokens"] == 0:
                raise PreparedDataError(f"the {split} split of {corpus.description} holds no text")
        meta = {
            "format": FORMAT,
            "key": key,
            "source": corpus.description,
            "tokenizer": tokenizer.kind,
            "tokenizer_fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "settings": settings.__dict__,
            "splits": splits,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta, False


def _replace_dir(new: Path, out: Path) -> None:
    """Rename the complete directory `new` to `out`; an earlier `out` is moved aside first, then deleted."""
    old = temp_path(out) if out.exists() else None
    if old is not None:
        out.rename(old)
    new.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
        bin_path, docs_path = _paths(directory, split)
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
