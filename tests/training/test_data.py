import numpy as np
import pytest
import torch

from training.data import BYTE_VOCAB, batch_at, check_vocab, load_corpus, split_train_val


def test_default_corpus_is_the_stdlib_as_bytes(tmp_path):
    corpus = load_corpus(None, tmp_path)
    assert corpus.vocab_size == BYTE_VOCAB and "standard library" in corpus.description
    assert len(corpus.tokens) > 1_000_000
    assert b"def " in bytes(np.asarray(corpus.tokens[:200_000], dtype=np.uint8))
    assert list(tmp_path.glob("stdlib-*.bin")), "byte tokens are cached as .bin"


def test_text_file_and_directory(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world\n" * 10)
    (tmp_path / "docs" / "b.md").write_text("héllo")
    (tmp_path / "docs" / "blob.dat").write_bytes(b"\0\1\2")  # binary: skipped
    one = load_corpus(str(tmp_path / "docs" / "a.txt"), tmp_path / "cache")
    assert bytes(np.asarray(one.tokens, dtype=np.uint8)) == b"hello world\n" * 10
    both = load_corpus(str(tmp_path / "docs"), tmp_path / "cache")
    assert bytes(np.asarray(both.tokens, dtype=np.uint8)) == (b"hello world\n" * 10) + b"\n" + "héllo".encode()


def test_token_files(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 5000, 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    for name in ("t.bin", "t.npy"):
        corpus = load_corpus(str(tmp_path / name), tmp_path)
        assert corpus.vocab_size is None
        np.testing.assert_array_equal(np.asarray(corpus.tokens), tokens)


def test_missing_path_and_bad_npy(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: .*nope.txt"):
        load_corpus(str(tmp_path / "nope.txt"), tmp_path)
    np.save(tmp_path / "f.npy", np.random.rand(4, 4))
    with pytest.raises(ValueError, match="1-d integer token array"):
        load_corpus(str(tmp_path / "f.npy"), tmp_path)


def test_split_needs_a_window_each():
    train, val = split_train_val(np.arange(1000), context_length=10, val_fraction=0.1)
    assert len(val) == 100 and len(train) == 900
    with pytest.raises(ValueError, match="too short .* context length 64"):
        split_train_val(np.arange(100), context_length=64)


def test_vocab_check():
    check_vocab(np.array([0, 255]), 256)
    with pytest.raises(ValueError, match="token id 300.*vocabulary is 256"):
        check_vocab(np.array([1, 300]), 256)


def test_batches_are_shifted_deterministic_and_split_across_ranks():
    tokens = np.arange(10_000) % 997
    x, y = batch_at(tokens, 8, 16, seed=3, step=5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    x2, _ = batch_at(tokens, 8, 16, seed=3, step=5)
    torch.testing.assert_close(x, x2)
    assert not torch.equal(x, batch_at(tokens, 8, 16, seed=3, step=6)[0])
    halves = [batch_at(tokens, 8, 16, seed=3, step=5, rank=r, world_size=2)[0] for r in (0, 1)]
    torch.testing.assert_close(torch.cat(halves), x)
    with pytest.raises(ValueError, match="global batch 8 is not divisible by world size 3"):
        batch_at(tokens, 8, 16, seed=3, step=5, world_size=3)
