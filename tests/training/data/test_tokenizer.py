import sysconfig
from pathlib import Path

import numpy as np
import pytest

from training.data.tokenizer import (EOD_TOKEN, BPETokenizer, ByteTokenizer, TokenizerError, check_vocab_size,
                                     load_tokenizer, token_dtype)

UNICODE = ("naïve café — 日本語のテキスト, emoji 🎉🚀, Ωμέγα, combining e\u0301, zero-width \u200b, "
           "tab\tand\r\nCRLF")


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py")] + [UNICODE] * 3
    return BPETokenizer.train(texts, vocab_size=600)


def random_unicode(rng: np.random.Generator, n: int) -> str:
    """Code points from every plane but the surrogates (which UTF-8 cannot carry)."""
    points = rng.integers(1, 0x110000, size=n)
    return "".join(chr(p) for p in points if not 0xD800 <= p < 0xE000)


def test_bpe_round_trips_ascii_unicode_and_random_text(bpe):
    rng = np.random.default_rng(0)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = ["def f(x):\n    return x + 1\n", UNICODE, random_unicode(rng, 2000), "", "   \n\n\t ",
             (stdlib / "fnmatch.py").read_text(), f"a literal {EOD_TOKEN} inside text"]
    for text, ids in zip(texts, bpe.encode_batch(texts)):
        assert bpe.decode(ids) == text
        # The bytes each token stands for add up to the text's UTF-8 bytes: bits per byte rest on it.
        assert int(bpe.token_bytes()[ids].sum()) == len(text.encode())
    assert bpe.eod_id not in bpe.encode_batch([texts[-1]])[0], "text never produces the end-of-document token"


def test_bpe_compresses_and_keeps_its_vocabulary(bpe):
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    assert len(bpe.encode_batch([text])[0]) < len(text.encode()) / 2
    assert bpe.vocab_size == 600 and bpe.token_bytes()[bpe.eod_id] == 1


def test_bytes_round_trip_any_bytes():
    tok = ByteTokenizer()
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    assert tok.decode_bytes(np.frombuffer(data, dtype=np.uint8)) == data
    for text in ("plain ascii\n", UNICODE):
        ids = tok.encode_batch([text])[0]
        assert tok.decode(ids) == text and len(ids) == len(text.encode())
    assert (tok.token_bytes() == 1).all() and tok.vocab_size == 256 and tok.eod_id == 0
    # A model with a larger vocabulary than the bytes can sample ids of 256 and more: they decode to nothing.
    assert tok.decode_bytes(np.array([104, 256, 105, 70_000])) == b"hi"


def test_tokenizer_file_reloads(bpe, tmp_path):
    bpe.save(tmp_path)
    again = load_tokenizer("bpe", tmp_path)
    text = UNICODE + " def main(): pass"
    assert again.encode_batch([text])[0].tolist() == bpe.encode_batch([text])[0].tolist()
    assert again.fingerprint() == bpe.fingerprint() and again.eod_id == bpe.eod_id
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer("bpe", tmp_path / "elsewhere")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        load_tokenizer("bpe", tmp_path)


@pytest.mark.parametrize("kind, size, message", [
    ("bpe", 255, "below 257"), ("bpe", 256, "below 257"), ("bpe", 2**32 + 1, "above 2\\^32"),
    ("bytes", 512, "exactly 256"), ("words", 1000, "unknown tokenizer 'words'")])
def test_bad_vocabulary_sizes(kind, size, message):
    with pytest.raises(TokenizerError, match=message):
        check_vocab_size(kind, size)


def test_token_dtype_by_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(2**16) == np.uint16
    assert token_dtype(2**16 + 1) == np.uint32 and token_dtype(2**32) == np.uint32
