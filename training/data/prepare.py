"""Writing a prepared directory: train a tokenizer on a text corpus, encode it, write the files prepared.py reads.

Preparing is keyed by a content hash of the input and the settings: a second run on the same input finds the result
and returns at once. The directory is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import tokenizers

from training.data.corpus import Segment, TextCorpus, content_hash, documents, split_segments
from training.data.prepared import FORMAT, META_FILE, SPLITS, PreparedDataError, read_meta, split_paths
from training.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, check_vocab_size, token_dtype
from training.progress import Progress
from training.run.files import fsync_dir, temp_path

PIECE_CHARS = 1 << 20  # longest text handed to the encoder at once
BATCH_CHARS = 2 << 20  # text per parallel encode call: bounds the memory of a batch of pieces and their tokens


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


def _tokenizer_texts(segments: list[Segment], settings: Settings, train_bytes: int) -> Iterator[str]:
    """The training split's text, or an evenly spread sample of it when it exceeds tokenizer_sample_bytes."""
    ratio = min(1.0, settings.tokenizer_sample_bytes / max(train_bytes, 1))
    seen = kept = 0
    bar = Progress(train_bytes, "train tokenizer: read", unit="B", every_s=10.0)
    try:
        for seg in segments:
            if seg.split != "train":
                continue
            for text, _ in documents(seg, settings.separator, PIECE_CHARS, bar):
                n = len(text)
                if kept <= seen * ratio:  # keeps the running share of text at `ratio`
                    kept += n
                    yield text
                seen += n
    finally:
        bar.close()


class _SplitWriter:
    """Appends one split's tokens to its .bin and collects its document starts and counts."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, eod_id: int):
        self.bin_path, self.docs_path = split_paths(directory, split)
        self.file = open(self.bin_path, "wb")
        self.dtype, self.eod = dtype, np.array([eod_id], dtype=dtype)
        self.tokens = self.bytes = 0
        self.crc = 0  # of the bytes written: the checksum meta.json records for load_prepared to verify
        self.doc_starts: list[int] = []

    def write(self, ids: np.ndarray, n_bytes: int, starts_document: bool) -> None:
        if starts_document:
            self.doc_starts.append(self.tokens)
            self._write(self.eod.tobytes())
            self.tokens += 1
            self.bytes += 1
        self._write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)
        self.bytes += n_bytes

    def _write(self, data: bytes) -> None:
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        np.save(self.docs_path, np.asarray(self.doc_starts, dtype=np.int64))
        return {"tokens": self.tokens, "bytes": self.bytes, "documents": len(self.doc_starts),
                "checksum": f"crc32:{self.crc:08x}:{self.tokens}"}


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

    bar = Progress(total_bytes, "encode", unit="B", every_s=10.0)
    try:
        size = 0
        for seg in segments:
            for text, starts in documents(seg, settings.separator, PIECE_CHARS, bar):
                batch.append((text, starts, seg.split))
                size += len(text)
                if size >= BATCH_CHARS:
                    flush()
                    size = 0
        flush()
    finally:
        bar.close()
    return {s: w.close() for s, w in writers.items()}


def check_out(out: Path, key: str, overwrite: bool) -> Optional[dict]:
    """What `out` holds: the meta of the same preparation (to reuse), None (free, or replaceable with overwrite), or
    a PreparedDataError naming what is there."""
    if not out.exists():
        return None
    meta = read_meta(out) if out.is_dir() else None
    if meta is not None and meta.get("key") == key:
        return meta
    if meta is None and (not out.is_dir() or any(out.iterdir())):
        raise PreparedDataError(f"--out {out} exists and is not a prepared data directory (no {META_FILE}); choose "
                                "another --out")
    if meta is not None and not overwrite:
        raise PreparedDataError(f"--out {out} holds data prepared from another input or settings ({meta.get('source')}"
                                f", {meta.get('tokenizer')} {meta.get('vocab_size')}); pass --overwrite to replace it")
    return None


def prepare(corpus: TextCorpus, out: Path, settings: Settings = Settings(),
            overwrite: bool = False) -> tuple[dict, bool]:
    """Tokenize `corpus` into the prepared directory `out`; returns (its meta, whether an earlier result was reused).

    An existing `out` prepared from the same content with the same settings is reused as it is; one from other
    content is replaced (atomically) only with `overwrite`; any other existing non-empty directory is refused.
    """
    settings.check()
    key = content_hash(corpus, settings.key_text())
    earlier = check_out(out, key, overwrite)
    if earlier is not None:
        return earlier, True
    segments = split_segments(corpus, settings.val_fraction)
    total = sum(s.end - s.start for s in segments)
    if total == 0:
        raise PreparedDataError(f"the corpus is empty: {corpus.description}")
    if not any(s.split == "val" for s in segments):
        raise PreparedDataError(f"the corpus is too short to hold out {settings.val_fraction:.0%} for validation "
                                f"(its last line is longer than that): {corpus.description}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        meta = _write(corpus, segments, settings, key, tmp, total)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta, False


def _write(corpus: TextCorpus, segments: list[Segment], settings: Settings, key: str, tmp: Path,
           total: int) -> dict:
    """Train the tokenizer, encode every split into `tmp` and write meta.json last; returns the meta."""
    train_bytes = sum(s.end - s.start for s in segments if s.split == "train")
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
        "format": FORMAT, "key": key, "source": corpus.description, "tokenizer": tokenizer.kind,
        "tokenizer_fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id, "dtype": token_dtype(tokenizer.vocab_size).name, "settings": settings.__dict__,
        "splits": {name: {k: v for k, v in counts.items() if k != "checksum"} for name, counts in splits.items()},
        "checksums": {name: counts["checksum"] for name, counts in splits.items()},
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def remove_leftovers(out: Path) -> list[Path]:
    """Delete the temporary directories that killed preparations of `out` left next to it; returns them. Only
    with `out`'s lock held: a live preparation's directory would go too."""
    removed = []
    for p in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _replace_dir(new: Path, out: Path) -> None:
    """Rename the complete directory `new` to `out`; an earlier `out` is moved aside first, then deleted."""
    old = temp_path(out) if out.exists() else None
    if old is not None:
        out.rename(old)
    new.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
