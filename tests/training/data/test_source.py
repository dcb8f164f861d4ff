"""training/data/source.py and training/data/__init__.py: every kind of --data as one DataSource, and its checks."""

import numpy as np
import pytest

from training.data import DataError, DataSource, open_source, vocab_of
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.prepared import load_prepared
from training.data.source import check_token_ids, content_crc, split_train_val
from training.data.synthetic import SYNTHETIC_TOKENS, SYNTHETIC_VOCAB
from training.data.tokenizer import BYTE_VOCAB

CONTEXT = 16


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    """A prepared directory of byte tokens (no BPE to train: quick) from two small files."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("Once upon a time.<|endoftext|>The end.\n" * 20)
    (root / "corpus" / "b.txt").write_text("def f(x):\n    return x\n" * 40)
    prepare(resolve(str(root / "corpus")), root / "out", Settings(tokenizer="bytes", vocab_size=BYTE_VOCAB))
    return root / "out"


def test_open_source_dispatches_every_kind(tmp_path, prepared_dir):
    cache = tmp_path / "cache"
    tokens = np.random.default_rng(0).integers(0, 5000, 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int64))
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("hello again\n" * 20)

    builtin = open_source(None, CONTEXT, cache)
    assert "standard library" in builtin.description
    for spec in (str(tmp_path / "a.txt"), str(tmp_path / "docs"), None):
        source = builtin if spec is None else open_source(spec, CONTEXT, cache)
        assert source.vocab_size == BYTE_VOCAB and (source.token_bytes == 1).all() and not source.has_documents
        assert source.identity == {"kind": "bytes", "source": spec or "builtin",
                                   "fingerprint": content_crc(np.concatenate([source.train, source.val]))}
        assert source.tokenizer is None
    assert open_source(str(tmp_path / "docs"), CONTEXT, cache).description.startswith("text files under ")

    for name in ("t.bin", "t.npy"):
        source = open_source(str(tmp_path / name), CONTEXT, cache)
        assert source.vocab_size is None and source.token_bytes is None and not source.has_documents
        assert source.identity == {"kind": "tokens", "source": str(tmp_path / name),
                                   "fingerprint": content_crc(np.concatenate([source.train, source.val]))}
        np.testing.assert_array_equal(np.concatenate([source.train, source.val]), tokens)

    prepared = open_source(str(prepared_dir), CONTEXT, cache)
    data = load_prepared(prepared_dir)
    assert prepared.vocab_size == data.vocab_size == BYTE_VOCAB and prepared.eod_id == data.eod_id == 0
    assert prepared.has_documents and prepared.tokenizer.kind == "bytes"
    np.testing.assert_array_equal(prepared.token_bytes, data.tokenizer().token_bytes())
    for split in ("train", "val"):
        np.testing.assert_array_equal(prepared.split(split), data.splits[split].tokens)
        np.testing.assert_array_equal(prepared.doc_starts[split], data.splits[split].doc_starts)
    assert prepared.identity == {
        "kind": "prepared", "source": str(prepared_dir), "corpus": data.meta["source"],
        "fingerprint": f"prepared:{data.meta['key']}",
        "tokenizer": "bytes", "tokenizer_fingerprint": data.meta["tokenizer_fingerprint"], "vocab_size": BYTE_VOCAB,
        "eod_id": 0}

    synthetic = open_source("synthetic", CONTEXT, cache, seed=3)
    assert synthetic.vocab_size == SYNTHETIC_VOCAB and synthetic.token_bytes is None and not synthetic.has_documents
    assert len(synthetic.train) + len(synthetic.val) == SYNTHETIC_TOKENS
    assert int(np.max(synthetic.train)) < SYNTHETIC_VOCAB
    assert synthetic.identity == {"kind": "synthetic", "source": "synthetic", "vocab_size": SYNTHETIC_VOCAB, "seed": 3,
                                  "fingerprint": f"synthetic:{SYNTHETIC_VOCAB}:3"}
    again, other = open_source("synthetic", CONTEXT, cache, seed=3), open_source("synthetic", CONTEXT, cache, seed=4)
    np.testing.assert_array_equal(again.train, synthetic.train)
    assert not np.array_equal(other.train, synthetic.train)
    wide = open_source("synthetic", CONTEXT, cache, vocab_size=70_000)
    assert wide.vocab_size == 70_000 and int(np.max(wide.train)) >= 2**16 and wide.train.dtype == np.int64
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin"] * 3, "only the text kinds are cached"


def test_vocab_size_must_agree_with_prepared_data(tmp_path, prepared_dir):
    with pytest.raises(DataError, match=rf"^--vocab-size 300 disagrees with the prepared data {prepared_dir}, whose "
                                        rf"tokenizer has 256 tokens; leave --vocab-size out$"):
        open_source(str(prepared_dir), CONTEXT, tmp_path, vocab_size=300)
    assert open_source(str(prepared_dir), CONTEXT, tmp_path, vocab_size=BYTE_VOCAB).vocab_size == BYTE_VOCAB


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=rf"^--data path does not exist: {tmp_path}/nope.txt$"):
        open_source(str(tmp_path / "nope.txt"), CONTEXT, tmp_path)


def test_vocab_of_takes_the_flag_else_the_data_s_and_checks_every_id():
    tokens = np.array([1, 2, 4999, 3] * 20, dtype=np.uint16)
    source = DataSource(tokens[:60], tokens[60:], "t.bin", None)
    assert vocab_of(source, None) == SYNTHETIC_VOCAB and vocab_of(source, 5000) == 5000
    with pytest.raises(DataError, match=r"^t.bin holds token id 4999, but the model's vocabulary is 4000; pass "
                                        r"--vocab-size 5000 or more$"):
        vocab_of(source, 4000)
    val_only = DataSource(np.array([1, 2], dtype=np.uint16), np.array([1, 300], dtype=np.uint16), "bytes", 256)
    with pytest.raises(DataError, match="holds token id 300, but the model's vocabulary is 256"):
        vocab_of(val_only, None)  # the validation split is checked too


def test_split_needs_a_window_each():
    train, val = split_train_val(np.arange(1000), context_length=10, val_fraction=0.1)
    assert len(val) == 100 and len(train) == 900
    np.testing.assert_array_equal(np.concatenate([train, val]), np.arange(1000))
    train, val = split_train_val(np.arange(100), context_length=10, val_fraction=0.01)
    assert len(val) == 11, "at least one window and its target"
    with pytest.raises(DataError, match="^the corpus has 100 tokens, too short .* context length 64 "
                                        r"\(needs at least 130\)$"):
        split_train_val(np.arange(100), context_length=64)


def test_token_ids_must_index_the_vocabulary(tmp_path):
    check_token_ids(np.array([0, 5, 9], dtype=np.int64), 10, "t.npy")
    check_token_ids(np.array([0, 255]), 256)
    with pytest.raises(DataError, match=r"^t.npy holds token id -1 \(the first negative one at position 2\); "
                                        r"ids must be in \[0, 10\)$"):
        check_token_ids(np.array([3, 4, -1, 5, -1]), 10, "t.npy")
    with pytest.raises(DataError, match=r"^t.bin holds token id 10, but the model's vocabulary is 10; pass "
                                        r"--vocab-size 11 or more$"):
        check_token_ids(np.array([3, 10], dtype=np.uint16), 10, "t.bin")
    with pytest.raises(DataError, match=r"^the data holds token id 300, but the model's vocabulary is 256"):
        check_token_ids(np.array([1, 300]), 256)
    with pytest.raises(DataError, match="^t.npy holds no tokens$"):
        check_token_ids(np.array([], dtype=np.int32), 10, "t.npy")
    path = tmp_path / "m.npy"  # a memmap, as the data is opened
    np.save(path, np.array([1, -7, 2], dtype=np.int32))
    with pytest.raises(DataError, match="holds token id -7"):
        check_token_ids(np.load(path, mmap_mode="r"), 10, str(path))
