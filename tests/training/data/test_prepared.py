"""training/data/prepared.py: reading a prepared directory, checked against its meta.json."""

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from training.data import DataError
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.prepared import PreparedDataError, is_prepared, load_prepared, open_prepared, read_meta

BYTES = Settings(tokenizer="bytes", vocab_size=256)
STDLIB = Path(sysconfig.get_paths()["stdlib"])


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


@pytest.fixture
def bpe(tmp_path) -> tuple[Path, Path]:
    """Two prepared BPE directories of the same vocabulary size, from two corpora: their tokenizers differ."""
    dirs = []
    for name, source in (("one", "textwrap.py"), ("two", "shlex.py")):
        (tmp_path / f"{name}.txt").write_text((STDLIB / source).read_text())
        prepare(resolve(str(tmp_path / f"{name}.txt")), tmp_path / f"bpe-{name}", Settings(vocab_size=300))
        dirs.append(tmp_path / f"bpe-{name}")
    return dirs[0], dirs[1]


def edit_meta(directory: Path, change) -> None:
    meta = read_meta(directory)
    change(meta)
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(dtype="uint32"), r"meta.json says dtype 'uint32', but a vocabulary of 300 is stored as uint16; "
                                         "prepare the data again$"),
    (lambda m: m.update(dtype="int8"), r"meta.json says dtype 'int8', but a vocabulary of 300 is stored as uint16"),
    (lambda m: m.pop("eod_id"), r"meta.json lacks 'eod_id' or it is not a int; prepare the data again$"),
    (lambda m: m.pop("tokenizer_fingerprint"), r"meta.json lacks 'tokenizer_fingerprint' or it is not a str"),
    (lambda m: m.update(vocab_size="300"), r"meta.json lacks 'vocab_size' or it is not a int"),
    (lambda m: m["splits"].pop("val"), r"meta.json lacks the val split's tokens, bytes, documents"),
    (lambda m: m["splits"]["train"].pop("documents"), r"meta.json lacks the train split's tokens, bytes, documents"),
    (lambda m: m.update(eod_id=300), r"meta.json: eod_id 300 is outside the vocabulary of 300$"),
    (lambda m: m.update(vocab_size=320), r"tokenizer.json is not the tokenizer meta.json records \(fingerprint "
                                         r"\w+, vocabulary 300; recorded \w+, 320\); prepare the data again$"),
    (lambda m: m["splits"]["train"].update(documents=m["splits"]["train"]["documents"] + 1),
     r"train_docs.npy lists 1 documents, meta.json 2; prepare it again$"),
    (lambda m: m["splits"]["val"].update(tokens=m["splits"]["val"]["tokens"] - 1),
     r"val.bin holds \d+ bytes, but meta.json says \d+ uint16 tokens; prepare it again$"),
], ids=["dtype-too-wide", "dtype-not-unsigned", "no-eod-id", "no-tokenizer-fingerprint", "vocab-a-string",
        "no-val-split", "no-doc-count", "eod-outside", "vocab-disagrees-with-tokenizer", "doc-count", "token-count"])
def test_meta_json_that_disagrees_is_one_line_naming_the_file_and_key(bpe, change, message):
    one, _ = bpe
    edit_meta(one, change)
    with pytest.raises(PreparedDataError) as e:
        load_prepared(one)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(one))
    assert re.search(message, str(e.value)), str(e.value)


def test_a_swapped_tokenizer_is_refused(bpe):
    one, two = bpe
    assert read_meta(one)["vocab_size"] == read_meta(two)["vocab_size"] == 300
    (one / "tokenizer.json").write_bytes((two / "tokenizer.json").read_bytes())
    with pytest.raises(PreparedDataError, match=rf"^{one}/tokenizer.json is not the tokenizer meta.json records "
                                                rf"\(fingerprint {read_meta(two)['tokenizer_fingerprint']}, vocabulary "
                                                rf"300; recorded {read_meta(one)['tokenizer_fingerprint']}, 300\)"):
        open_prepared(one, context_length=8)
    (one / "tokenizer.json").unlink()
    with pytest.raises(PreparedDataError, match=rf"^{one}: {one} has no tokenizer.json$"):
        load_prepared(one)


@pytest.mark.parametrize("split", ["train", "val"])
def test_flipped_bytes_in_a_token_file_are_named(out, split):
    path = out / f"{split}.bin"
    data = bytearray(path.read_bytes())
    for i in (10, 11, 12):
        data[i] ^= 0x01  # still byte ids below 256: only the checksum tells
    path.write_bytes(bytes(data))
    with pytest.raises(PreparedDataError, match=rf"^{path} does not match the checksum written with it \(the file is "
                                                r"damaged or was replaced\); prepare it again$"):
        open_prepared(out, context_length=8)


def test_truncated_token_files_are_named(out):
    path = out / "train.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(PreparedDataError, match=rf"^{path} holds {len(data) - 1} bytes, not a whole number of uint16 "
                                                "tokens; prepare it again$"):
        load_prepared(out)
    path.write_bytes(data[:-2])
    with pytest.raises(PreparedDataError, match=rf"^{path} holds {len(data) - 2} bytes, but meta.json says "
                                                rf"{len(data) // 2} uint16 tokens; prepare it again$"):
        load_prepared(out)
