"""training/data/prepared.py: reading a prepared directory, checked against its meta.json."""

import json
from pathlib import Path

import numpy as np
import pytest

from training.data import DataError
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.prepared import PreparedDataError, is_prepared, load_prepared, open_prepared, read_meta

BYTES = Settings(tokenizer="bytes", vocab_size=256)


@pytest.fixture
def out(tmp_path) -> Path:
    """A prepared directory of byte tokens: three documents in two files."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first story<|endoftext|>second story\n" * 3)
    (corpus / "b.txt").write_text("a line of text\n" * 30)
    prepare(resolve(str(corpus)), tmp_path / "out", BYTES)
    return tmp_path / "out"


def test_open_prepared_is_the_directory_as_a_data_source(out):
    meta = read_meta(out)
    source = open_prepared(out, context_length=8)
    assert isinstance(source.train, np.memmap) and source.train.dtype == np.uint16
    assert len(source.train) == meta["splits"]["train"]["tokens"] and len(source.val) == meta["splits"]["val"]["tokens"]
    assert source.has_documents and source.eod_id == 0 and source.vocab_size == 256
    for split in ("train", "val"):
        tokens, starts = np.asarray(source.split(split)), source.doc_starts[split]
        assert (tokens[starts] == 0).all() and (tokens == 0).sum() == len(starts) == meta["splits"][split]["documents"]
    assert source.description == f"bytes tokens of {meta['source']}, prepared in {out}"
    assert bytes(np.asarray(source.train[1:12]).astype(np.uint8)) == b"first story"


def test_a_split_shorter_than_a_window(out):
    val_tokens = read_meta(out)["splits"]["val"]["tokens"]
    open_prepared(out, context_length=val_tokens - 1)
    with pytest.raises(PreparedDataError, match=rf"^the val split of {out} has {val_tokens} tokens, fewer than one "
                                                rf"window of context length {val_tokens} plus one$"):
        open_prepared(out, context_length=val_tokens)


def test_damaged_prepared_directories(out):
    (out / "val.bin").write_bytes((out / "val.bin").read_bytes()[:-2])
    with pytest.raises(PreparedDataError, match="val.bin holds .* bytes, but meta.json says .* uint16 tokens"):
        load_prepared(out)
    (out / "train_docs.npy").unlink()
    with pytest.raises(PreparedDataError, match=rf"^{out} lacks train_docs.npy, which meta.json lists"):
        load_prepared(out)
    meta = read_meta(out)
    (out / "meta.json").write_text(json.dumps({**meta, "format": 0}))
    with pytest.raises(PreparedDataError, match=r"meta.json has format 0, this code reads 1; prepare the data again"):
        load_prepared(out)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(PreparedDataError, match=r"meta.json is not valid JSON"):
        load_prepared(out)
    (out / "meta.json").unlink()
    assert is_prepared(out)
    with pytest.raises(PreparedDataError, match="holds token files but no meta.json"):
        load_prepared(out)
    assert issubclass(PreparedDataError, DataError), "train.py reports it as a data error: one line, exit 1"


def test_what_counts_as_prepared(tmp_path, out):
    assert is_prepared(out) and not is_prepared(tmp_path / "corpus") and not is_prepared(out / "train.bin")
    assert read_meta(tmp_path / "corpus") is None
