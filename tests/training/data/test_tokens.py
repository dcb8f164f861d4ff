"""training/data/tokens.py: .bin (uint16, no header) and .npy token files."""

from pathlib import Path

import numpy as np
import pytest

from training.data import DataError
from training.data.source import content_crc
from training.data.tokens import open_tokens


def test_token_files(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 5000, 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    for name in ("t.bin", "t.npy"):
        source = open_tokens(tmp_path / name, context_length=16)
        assert source.vocab_size is None and source.token_bytes is None and not source.has_documents
        np.testing.assert_array_equal(np.concatenate([source.train, source.val]), tokens)
        assert len(source.val) == 50
        assert source.identity == {"kind": "tokens", "source": str(tmp_path / name),
                                   "fingerprint": content_crc(np.concatenate([source.train, source.val]))}
    assert open_tokens(tmp_path / "t.bin", 16).description == f"uint16 token file {tmp_path / 't.bin'}"


def test_bad_npy(tmp_path):
    np.save(tmp_path / "f.npy", np.random.rand(4, 4))
    with pytest.raises(DataError, match=r"f.npy must hold a 1-d integer token array, got shape \(4, 4\), float64"):
        open_tokens(tmp_path / "f.npy", 16)
    (tmp_path / "text.npy").write_text("not numpy at all")
    with pytest.raises(DataError, match=r"^--data .*text.npy is not a .npy array of token ids"):
        open_tokens(tmp_path / "text.npy", 16)


def test_bin_files_hold_whole_uint16_values(tmp_path):
    odd, empty, good = tmp_path / "odd.bin", tmp_path / "empty.bin", tmp_path / "good.bin"
    odd.write_bytes(b"\1" * 1001)
    empty.write_bytes(b"")
    good.write_bytes(b"\1" * 1000)
    with pytest.raises(DataError, match=rf"^--data {odd} has an odd number of bytes \(1,001\): a .bin token file "
                                        r"holds uint16 ids of 2 bytes each"):
        open_tokens(odd, 16)
    with pytest.raises(DataError, match=rf"^--data {empty} is empty$"):
        open_tokens(empty, 16)
    source = open_tokens(good, 16)
    assert len(source.train) + len(source.val) == 500 and (np.asarray(source.train) == 0x0101).all()


def test_too_short_for_a_window_each(tmp_path):
    np.arange(30, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(DataError, match=r"^uint16 token file .*short.bin has 30 tokens, too short for a training and "
                                        r"a validation window of context length 16 \(needs at least 34\)$"):
        open_tokens(Path(tmp_path / "short.bin"), 16)
