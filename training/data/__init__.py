"""The data of a run: sources by kind behind one DataSource (source.py), batches (sampling.py), tokenizers,
prepared directories (prepared.py reads them, prepare.py writes them) and what a run records of its data."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from training.data.source import DataError, DataSource, check_token_ids
from training.data.synthetic import SYNTHETIC_VOCAB


def open_source(spec: Optional[str], context_length: int, cache_dir: Path, vocab_size: Optional[int] = None,
                seed: int = 0, warn: Optional[Callable[[str], None]] = None) -> DataSource:
    """--data as a DataSource: None (the built-in corpus), 'synthetic', a prepared directory, a .bin/.npy token file,
    a text file or a directory of text files. `vocab_size`: --vocab-size, which prepared data must agree with."""
    from training.data.prepared import is_prepared, open_prepared
    from training.data.synthetic import open_synthetic
    from training.data.text import open_text
    from training.data.tokens import open_tokens

    if spec == "synthetic":
        return open_synthetic(vocab_size or SYNTHETIC_VOCAB, seed, context_length)
    if spec is not None:
        path = Path(spec)
        if not path.exists():
            raise DataError(f"--data path does not exist: {path}")
        if is_prepared(path):
            source = open_prepared(path, context_length)
            if vocab_size is not None and vocab_size != source.vocab_size:
                raise DataError(f"--vocab-size {vocab_size} disagrees with the prepared data {spec}, whose tokenizer "
                                f"has {source.vocab_size} tokens; leave --vocab-size out")
            return source
        if path.suffix in (".bin", ".npy"):
            return open_tokens(path, context_length)
    return open_text(spec, cache_dir, context_length, **({"warn": warn} if warn else {}))


def vocab_of(source: DataSource, asked: Optional[int]) -> int:
    """The model's vocabulary for this data: --vocab-size, else the data's, checked against every token id."""
    vocab = asked or source.vocab_size or SYNTHETIC_VOCAB
    for tokens in (source.train, source.val):
        check_token_ids(tokens, vocab, source.description)
    return vocab


__all__ = ["DataError", "DataSource", "open_source", "vocab_of"]
