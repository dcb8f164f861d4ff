"""The data of a run: its training and validation tokens, vocabulary, tokenizer and the bytes each token encodes.

`--data` is a prepared directory (prepare_data.py: BPE or bytes, with document boundaries and a tokenizer), or
anything training.data.load_corpus reads (default: the standard library sources as bytes; a text file or a
directory as bytes; a token file; 'synthetic'). A run on a prepared directory records its tokenizer in its output
directory (`record_tokenizer`), so that evaluation and sampling decode with the tokenizer it was trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from training.data import BYTE_VOCAB, load_corpus, split_train_val
from training.files import write_atomic
from training.prepared import PreparedData, is_prepared, load_prepared
from training.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer

RUN_TOKENIZER_FILE = "data.json"  # in a run's output directory: which prepared data and tokenizer it trained on


class DataMismatchError(ValueError):
    """Data, tokenizer and model that do not belong together; the one-line message names both sides."""


@dataclass(frozen=True)
class RunData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: Optional[int]  # None: the data does not say (token files)
    description: str
    token_bytes: Optional[np.ndarray] = None  # bytes per token id; None: unknown (token files, synthetic)
    prepared: Optional[PreparedData] = None

    @property
    def eod_id(self) -> Optional[int]:
        return self.prepared.eod_id if self.prepared else None

    def doc_starts(self, split: str) -> Optional[np.ndarray]:
        return self.prepared.splits[split].doc_starts if self.prepared else None


def load_run_data(spec: Optional[str], cache_dir: Path, context_length: int, synthetic_vocab: int = 10_000,
                  seed: int = 0) -> RunData:
    """Resolve --data; each split must hold a context window plus one token."""
    if spec not in (None, "synthetic") and is_prepared(Path(spec)):
        data = load_prepared(Path(spec))
        train, val = data.splits["train"].tokens, data.splits["val"].tokens
        for name, tokens in (("train", train), ("val", val)):
            if len(tokens) < context_length + 1:
                raise ValueError(f"the {name} split of {spec} has {len(tokens)} tokens, fewer than one window of "
                                 f"context length {context_length} plus one")
        return RunData(train, val, data.vocab_size, data.describe(), data.tokenizer().token_bytes(), data)
    corpus = load_corpus(spec, cache_dir, synthetic_vocab=synthetic_vocab, seed=seed)
    train, val = split_train_val(corpus.tokens, context_length)
    byte_level = spec != "synthetic" and corpus.vocab_size == BYTE_VOCAB
    return RunData(train, val, corpus.vocab_size, corpus.description,
                   np.ones(BYTE_VOCAB, dtype=np.int64) if byte_level else None)


def check_vocab_size(data: RunData, asked: Optional[int], spec: Optional[str]) -> None:
    """A prepared directory fixes the vocabulary: --vocab-size may only repeat it."""
    if data.prepared is not None and asked is not None and asked != data.vocab_size:
        raise DataMismatchError(f"--vocab-size {asked} disagrees with the prepared data {spec}, whose tokenizer has "
                                f"{data.vocab_size} tokens; leave --vocab-size out")


def record_tokenizer(data: RunData, out: Path) -> None:
    """Copy the prepared data's tokenizer and a note of the data into the run's output directory."""
    if data.prepared is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    meta = data.prepared.meta
    tokenizer_file = data.prepared.directory / TOKENIZER_FILE
    if tokenizer_file.exists():
        write_atomic(out / TOKENIZER_FILE, lambda f: f.write(tokenizer_file.read_bytes()))
    note = {"data": str(data.prepared.directory), "source": meta["source"], "tokenizer": meta["tokenizer"],
            "tokenizer_fingerprint": meta["tokenizer_fingerprint"], "vocab_size": meta["vocab_size"],
            "eod_id": meta["eod_id"]}
    write_atomic(out / RUN_TOKENIZER_FILE, lambda f: f.write((json.dumps(note, indent=2) + "\n").encode()))


def run_tokenizer_note(run_dir: Path) -> Optional[dict]:
    """What record_tokenizer wrote for a run; None for a run on other data (byte-level text, token files)."""
    path = run_dir / RUN_TOKENIZER_FILE
    return json.loads(path.read_text()) if path.exists() else None


def run_tokenizer(run_dir: Path) -> Optional[Tokenizer]:
    """The tokenizer a run trained with, from its output directory; None when it trained on no prepared data."""
    note = run_tokenizer_note(run_dir)
    return None if note is None else load_tokenizer(note["tokenizer"], run_dir)


def check_same_tokenizer(run_dir: Path, data: RunData, spec: Optional[str]) -> None:
    """Evaluating a run needs data tokenized as the run's training data was."""
    note = run_tokenizer_note(run_dir)
    name = spec or "the built-in corpus"
    if note is None:  # trained on byte-level text or token files: prepared data fits only if it is bytes too
        if data.prepared is not None and data.prepared.meta["tokenizer"] != "bytes":
            raise DataMismatchError(f"{name} holds {data.prepared.meta['tokenizer']} tokens, but the run in {run_dir} "
                                    "was not trained on prepared data (it records no tokenizer)")
        return
    if data.prepared is None:
        if note["tokenizer"] != "bytes":
            raise DataMismatchError(f"the run in {run_dir} was trained on {note['tokenizer']} tokens ({note['data']}); "
                                    f"{name} is not prepared with its tokenizer")
        return
    theirs = data.prepared.meta
    if note["tokenizer_fingerprint"] != theirs["tokenizer_fingerprint"]:
        raise DataMismatchError(f"{name} is tokenized with another tokenizer ({theirs['tokenizer']}, vocabulary "
                                f"{theirs['vocab_size']}) than the run in {run_dir} was trained with "
                                f"({note['tokenizer']}, vocabulary {note['vocab_size']}, from {note['data']})")
