"""The data-file checks of the former tests/training/test_input_checks.py, on the data modules that now hold them:
text that is not UTF-8 (training/data/text.py), .bin token files of whole uint16 values (training/data/tokens.py) and
token ids that index the vocabulary (training/data/source.py)."""

import numpy as np
import pytest

from training.data.source import DataError, check_token_ids
from training.data.text import open_text, text_problem
from training.data.tokens import open_tokens


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
    path = tmp_path / "a.txt"
    path.write_bytes("x".encode("utf-16"))
    with pytest.raises(DataError, match=rf"^--data {path} is UTF-16 text, not UTF-8"):
        open_text(str(path), tmp_path / "cache", context_length=8)


def test_bin_files_hold_whole_uint16_values(tmp_path):
    odd, empty, good = tmp_path / "odd.bin", tmp_path / "empty.bin", tmp_path / "good.bin"
    odd.write_bytes(b"\1" * 1001)
    empty.write_bytes(b"")
    good.write_bytes(b"\1" * 1000)
    with pytest.raises(DataError, match=rf"^--data {odd} has an odd number of bytes \(1,001\): a .bin token file "
                                        r"holds uint16 ids of 2 bytes each"):
        open_tokens(odd, context_length=8)
    with pytest.raises(DataError, match=rf"^--data {empty} is empty$"):
        open_tokens(empty, context_length=8)
    source = open_tokens(good, context_length=8)
    assert len(source.train) + len(source.val) == 500


def test_token_ids_must_index_the_vocabulary(tmp_path):
    check_token_ids(np.array([0, 5, 9], dtype=np.int64), 10, "t.npy")
    with pytest.raises(DataError, match=r"^t.npy holds token id -1 \(the first negative one at position 2\); "
                                        r"ids must be in \[0, 10\)$"):
        check_token_ids(np.array([3, 4, -1, 5, -1]), 10, "t.npy")
    with pytest.raises(DataError, match=r"^t.bin holds token id 10, but the model's vocabulary is 10; pass "
                                        r"--vocab-size 11 or more$"):
        check_token_ids(np.array([3, 10], dtype=np.uint16), 10, "t.bin")
    with pytest.raises(DataError, match="^t.npy holds no tokens$"):
        check_token_ids(np.array([], dtype=np.int32), 10, "t.npy")
    path = tmp_path / "m.npy"  # a memmap, as the data is opened
    np.save(path, np.array([1, -7, 2], dtype=np.int32))
    with pytest.raises(DataError, match="holds token id -7"):
        check_token_ids(np.load(path, mmap_mode="r"), 10, str(path))
