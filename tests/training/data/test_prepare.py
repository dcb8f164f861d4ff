import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from training.data import prepare as prepare_module
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.prepared import PreparedDataError, load_prepared
from training.data.tokenizer import ByteTokenizer, TokenizerError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_BPE = Settings(vocab_size=400)


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    """Five documents in three files: two stories in one file (separated), and two source files."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a_stories.txt").write_text("Once upon a time, a fox. ✨<|endoftext|>The end came soon.\n")
    (d / "b_textwrap.py").write_text((STDLIB / "textwrap.py").read_text())
    (d / "c_shlex.py").write_text((STDLIB / "shlex.py").read_text())
    return d


def documents_of(data, split):
    s = data.splits[split]
    tokens = np.asarray(s.tokens)
    bounds = list(s.doc_starts) + [len(tokens)]
    return [tokens[a + 1:b] for a, b in zip(bounds, bounds[1:])]  # each without its leading EOD


def test_bin_holds_exactly_the_encoded_documents(corpus_dir, tmp_path):
    meta, reused = prepare(resolve(str(corpus_dir)), tmp_path / "out", SMALL_BPE)
    assert not reused and meta["dtype"] == "uint16" and meta["vocab_size"] == 400
    data = load_prepared(tmp_path / "out")
    tok = data.tokenizer()
    docs = documents_of(data, "train") + documents_of(data, "val")
    text = [tok.decode(d) for d in docs]
    shlex = (corpus_dir / "c_shlex.py").read_text()
    # The validation split is the tail of the last file, from a line start on: a document of its own.
    assert text[:3] == ["Once upon a time, a fox. ✨", "The end came soon.\n",
                        (corpus_dir / "b_textwrap.py").read_text()]
    assert text[3] + text[4] == shlex and len(text) == 5 and len(documents_of(data, "val")) == 1
    for split in ("train", "val"):
        s, counts = data.splits[split], meta["splits"][split]
        tokens = np.asarray(s.tokens)
        assert (tokens[s.doc_starts] == tok.eod_id).all() and (tokens == tok.eod_id).sum() == len(s.doc_starts)
        assert counts["tokens"] == len(tokens) and counts["documents"] == len(s.doc_starts)
        assert int(tok.token_bytes()[tokens].sum()) == counts["bytes"] == s.bytes
        assert (tokens < data.vocab_size).all()
    # Re-encoding the text gives the same tokens: the file holds exactly what the tokenizer makes of the input.
    assert [d.tolist() for d in docs[:3]] == [ids.tolist() for ids in tok.encode_batch(text[:3])]


def test_bytes_tokenizer_keeps_bytes(corpus_dir, tmp_path):
    meta, _ = prepare(resolve(str(corpus_dir)), tmp_path / "out", Settings(tokenizer="bytes", vocab_size=256))
    data = load_prepared(tmp_path / "out")
    assert meta["tokenizer"] == "bytes" and meta["eod_id"] == 0 and not (tmp_path / "out" / "tokenizer.json").exists()
    first = documents_of(data, "train")[0]
    assert bytes(first.astype(np.uint8)) == "Once upon a time, a fox. ✨".encode()
    assert all(c["bytes"] == c["tokens"] for c in meta["splits"].values())


def test_large_vocabularies_are_stored_as_uint32(corpus_dir, tmp_path, monkeypatch):
    class WideBytes(ByteTokenizer):
        vocab_size = 70_000  # ids still bytes, but a vocabulary beyond uint16
    monkeypatch.setattr(prepare_module, "ByteTokenizer", WideBytes)
    monkeypatch.setattr("training.data.prepared.load_tokenizer", lambda kind, directory: WideBytes())
    meta, _ = prepare(resolve(str(corpus_dir)), tmp_path / "out", Settings(tokenizer="bytes", vocab_size=256))
    data = load_prepared(tmp_path / "out")
    assert meta["dtype"] == "uint32" and data.splits["train"].tokens.dtype == np.uint32
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * meta["splits"]["train"]["tokens"]


def test_small_pieces_and_batches_give_the_same_tokens(corpus_dir, tmp_path, monkeypatch):
    """Reading in small blocks, pieces and batches (bounded memory) changes no token."""
    prepare(resolve(str(corpus_dir)), tmp_path / "big", SMALL_BPE)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 300)
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 1000)
    monkeypatch.setattr("training.data.corpus.BLOCK_BYTES", 64)
    prepare(resolve(str(corpus_dir)), tmp_path / "small", SMALL_BPE)
    for split in ("train", "val"):
        a, b = (np.fromfile(tmp_path / d / f"{split}.bin", dtype=np.uint16) for d in ("big", "small"))
        np.testing.assert_array_equal(a, b)


def test_same_content_is_reused_and_changed_content_is_not(corpus_dir, tmp_path):
    out = tmp_path / "out"
    meta, reused = prepare(resolve(str(corpus_dir)), out, SMALL_BPE)
    stamp = (out / "train.bin").stat().st_mtime_ns
    again, reused = prepare(resolve(str(corpus_dir)), out, SMALL_BPE)
    assert reused and again == meta and (out / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(PreparedDataError, match=rf"^--out {out} holds data prepared from another input or settings "
                                                r"\(text files under .*corpus \(3 files\), bpe 400\); pass --overwrite "
                                                "to replace it$"):
        prepare(resolve(str(corpus_dir)), out, Settings(vocab_size=300))  # other settings
    assert json.loads((out / "meta.json").read_text()) == meta
    other, reused = prepare(resolve(str(corpus_dir)), out, Settings(vocab_size=300), overwrite=True)
    assert not reused and other["vocab_size"] == 300
    (corpus_dir / "a_stories.txt").write_text("A changed story.<|endoftext|>The end came soon.\n")
    changed, reused = prepare(resolve(str(corpus_dir)), out, Settings(vocab_size=300), overwrite=True)
    assert not reused and changed["key"] != other["key"]
    assert load_prepared(out).tokenizer().decode(documents_of(load_prepared(out), "train")[0]) == "A changed story."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"], "no temporary directory left behind"


def test_a_failed_prepare_leaves_the_old_result(corpus_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    meta, _ = prepare(resolve(str(corpus_dir)), out, SMALL_BPE)

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr(prepare_module, "_encode", broken)
    (corpus_dir / "a_stories.txt").write_text("new text\n")
    with pytest.raises(OSError, match="disk full"):
        prepare(resolve(str(corpus_dir)), out, SMALL_BPE, overwrite=True)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]


def test_bad_input(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PreparedDataError, match="the corpus is empty: text file .*empty.txt"):
        prepare(resolve(str(tmp_path / "empty.txt")), tmp_path / "out")
    (tmp_path / "one_line.txt").write_text("no newline at all " * 10)
    with pytest.raises(PreparedDataError, match="too short to hold out 5% for validation"):
        prepare(resolve(str(tmp_path / "one_line.txt")), tmp_path / "out")
    with pytest.raises(TokenizerError, match="below 257"):
        prepare(resolve(str(tmp_path / "one_line.txt")), tmp_path / "out", Settings(vocab_size=200))
    with pytest.raises(PreparedDataError, match="--val-fraction 1.0 must lie strictly between 0 and 1"):
        prepare(resolve(str(tmp_path / "one_line.txt")), tmp_path / "out", Settings(val_fraction=1.0))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "text.txt").write_text("some text\n" * 100)
    with pytest.raises(PreparedDataError, match="mine exists and is not a prepared data directory"):
        prepare(resolve(str(tmp_path / "text.txt")), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

