"""training/data/text.py: the built-in corpus, text files and directories of them, as cached bytes."""

import numpy as np
import pytest

from training.data import DataError
from training.data.source import content_crc
from training.data.text import open_text, text_problem
from training.data.tokenizer import BYTE_VOCAB


def all_bytes(source) -> bytes:
    """The whole stream of a byte-level source: its training split, then its validation split."""
    return bytes(np.concatenate([np.asarray(source.train), np.asarray(source.val)]).astype(np.uint8))


def test_default_corpus_is_the_stdlib_as_bytes(tmp_path):
    source = open_text(None, tmp_path, context_length=64)
    assert source.vocab_size == BYTE_VOCAB and "standard library" in source.description
    assert (source.token_bytes == 1).all() and len(source.token_bytes) == BYTE_VOCAB
    assert len(source.train) + len(source.val) > 1_000_000
    assert len(source.val) == int(0.05 * (len(source.train) + len(source.val)))
    assert b"def " in bytes(np.asarray(source.train[:200_000], dtype=np.uint8))
    assert source.identity == {"kind": "bytes", "source": "builtin",
                               "fingerprint": content_crc(np.concatenate([source.train, source.val]))}
    assert not source.has_documents
    assert list(tmp_path.glob("stdlib-*.bin")), "byte tokens are cached as .bin"


def test_text_file_and_directory(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world\n" * 10)
    (tmp_path / "docs" / "b.md").write_text("héllo")
    (tmp_path / "docs" / "blob.dat").write_bytes(bytes(range(256)) * 4)  # binary: skipped
    one = open_text(str(tmp_path / "docs" / "a.txt"), tmp_path / "cache", context_length=8)
    assert all_bytes(one) == b"hello world\n" * 10
    assert one.description == f"text file {tmp_path / 'docs' / 'a.txt'} (bytes)"
    warnings = []
    both = open_text(str(tmp_path / "docs"), tmp_path / "cache", context_length=8, warn=warnings.append)
    assert all_bytes(both) == (b"hello world\n" * 10) + b"\n" + "héllo".encode()
    assert both.vocab_size == BYTE_VOCAB and both.identity == {
        "kind": "bytes", "source": str(tmp_path / "docs"), "fingerprint": content_crc(np.concatenate([both.train,
                                                                                                      both.val]))}
    assert one.identity["fingerprint"] != both.identity["fingerprint"], "a fingerprint of the content"
    assert warnings == [f"warning: --data {tmp_path / 'docs'}: skipping {tmp_path / 'docs' / 'blob.dat'}, which is "
                        "binary, not text (it holds NUL bytes)"]
    # The cache is used the second time, and the warning is repeated from it.
    again = []
    assert all_bytes(open_text(str(tmp_path / "docs"), tmp_path / "cache", 8, warn=again.append)) == all_bytes(both)
    assert again == warnings


def test_directories_without_text(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=rf"^--data directory {tmp_path / 'empty'} holds no text files$"):
        open_text(str(tmp_path / "empty"), tmp_path / "cache", 8)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.dat").write_bytes(b"\0\1\2")
    (tmp_path / "binary" / "b.txt").write_bytes("naïve".encode("latin-1"))
    with pytest.raises(DataError, match=rf"^--data {tmp_path / 'binary'} holds no UTF-8 text file \(2 skipped\)$"):
        open_text(str(tmp_path / "binary"), tmp_path / "cache", 8, warn=lambda m: None)


@pytest.mark.parametrize("data, problem", [
    ("héllo wörld\n".encode(), None),
    (b"", "is empty"),
    ("hello".encode("utf-16"), "is UTF-16 text, not UTF-8 (it starts with a UTF-16 byte-order mark)"),
    ("hello".encode("utf-32"), "is UTF-32 text, not UTF-8"),
    ("some plain text".encode("utf-16-le"), "looks like UTF-16 text, not UTF-8 (every other byte is 0)"),
    (bytes(range(256)) * 4, "is binary, not text (it holds NUL bytes)"),
    ("naïve".encode("latin-1"), "is not UTF-8 text (byte 0xef at offset 2)"),
])
def test_text_that_is_not_utf8_says_what_it_is(data, problem):
    found = text_problem(data)
    assert found == problem if problem is None else found.startswith(problem)


def test_text_file_error_names_the_file(tmp_path):
    (tmp_path / "a.txt").write_bytes("x".encode("utf-16"))
    with pytest.raises(DataError, match=rf"^--data {tmp_path}/a.txt is UTF-16 text, not UTF-8"):
        open_text(str(tmp_path / "a.txt"), tmp_path / "cache", 8)
    assert not list((tmp_path / "cache").glob("a-*.bin")), "nothing cached for a file that is not text"
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(DataError, match=r"^text file .*short.txt \(bytes\) has 9 tokens, too short for a training "
                                        r"and a validation window of context length 8 \(needs at least 18\)$"):
        open_text(str(tmp_path / "short.txt"), tmp_path / "cache", 8)
