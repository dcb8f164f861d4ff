"""prepare_data.py end to end on small inputs."""

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import prepare_data
from training.data.prepared import load_prepared
from training.run.directory import RunLock


@pytest.fixture
def stories(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("<|endoftext|>".join(f"Story {i}: the fox {'jumps ' * i}over the dog.\nThe end.\n"
                                         for i in range(200)))
    return path


def test_prepare_a_text_file_then_reuse_it(stories, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: prepared in" in printed and "bpe tokenizer, vocabulary 300, uint16" in printed
    assert f"train on it: python train.py --data {out}" in printed
    data = load_prepared(out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 201  # one cut in two
    assert data.tokenizer().decode(data.splits["train"].tokens[1:data.splits["train"].doc_starts[1]]) == \
        "Story 0: the fox over the dog.\nThe end.\n"
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    assert "already prepared from the same input and settings; reused" in capsys.readouterr().out


def test_bytes_and_default_output_name(stories, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert prepare_data.main([str(stories), "--tokenizer", "bytes"]) == 0
    data = load_prepared(tmp_path / "data" / "stories-bytes")
    tokens = np.asarray(data.splits["train"].tokens)
    assert data.vocab_size == 256 and bytes(tokens[1:9].astype(np.uint8)) == b"Story 0:"


@pytest.mark.parametrize("make, extra, message", [
    (lambda p: p.write_bytes(b""), [], "error: the corpus is empty: text file .*in.txt"),
    (lambda p: p.write_bytes("caf\xe9\n".encode("latin-1") * 50), [],
     "error: .*in.txt is not UTF-8 text \\(invalid byte at offset 3\\)"),
    (lambda p: p.write_text("text\n" * 50), ["--vocab-size", "100"], "error: --vocab-size 100 is below 257"),
    (lambda p: p.write_text("text\n" * 50), ["--vocab-size", str(2**32 + 1)], "error: --vocab-size .* above 2\\^32"),
    (lambda p: p.write_text("text\n" * 50), ["--tokenizer", "bytes", "--vocab-size", "300"],
     "error: --vocab-size 300: the bytes tokenizer has exactly 256 tokens"),
])
def test_bad_input_is_one_line(tmp_path, capsys, make, extra, message):
    make(tmp_path / "in.txt")
    assert prepare_data.main([str(tmp_path / "in.txt"), "--out", str(tmp_path / "out"), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.match(message, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, named", [(["--tokenizer", "wordpiece"], "--tokenizer"),
                                         (["--vocab-size", "big"], "--vocab-size"),
                                         (["--no-such-flag"], "--no-such-flag")])
def test_a_bad_flag_is_one_line_without_usage(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        prepare_data.main([str(tmp_path / "in.txt"), "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert named in captured.err and "usage" not in captured.err
    assert not (tmp_path / "out").exists()


def tree(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file and directory under `directory`: its size and a hash of its content."""
    return {str(p.relative_to(directory)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file() else (0, "dir") for p in sorted(directory.rglob("*"))}


def one_error(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    return err.rstrip("\n")


@pytest.fixture
def other(tmp_path):
    path = tmp_path / "other.txt"
    path.write_text("<|endoftext|>".join(f"Note {i}: a cat {'naps ' * i}in the sun.\n" for i in range(150)))
    return path


def test_another_corpus_replaces_a_prepared_directory_only_with_overwrite(stories, other, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    before = tree(out)
    assert prepare_data.main([str(other), "--out", str(out), "--vocab-size", "300"]) == 1
    assert one_error(capsys.readouterr().err) == (
        f"error: --out {out} holds data prepared from another input or settings (text file {stories}, bpe 300); pass "
        "--overwrite to replace it")
    assert tree(out) == before
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "280"]) == 1  # other settings too
    assert "pass --overwrite to replace it" in one_error(capsys.readouterr().err)
    assert tree(out) == before
    assert prepare_data.main([str(other), "--out", str(out), "--vocab-size", "300", "--overwrite"]) == 0
    assert f"{out}: prepared in" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["source"] == f"text file {other}"
    data = load_prepared(out)
    first = data.splits["train"].tokens[1:data.splits["train"].doc_starts[1]]
    assert data.tokenizer().decode(first) == "Note 0: a cat in the sun.\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "prepared", "stories.txt"], "nothing left over"


def test_a_second_preparation_of_one_out_is_refused_while_the_first_holds_it(stories, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    before = tree(out)
    lock = RunLock(out, path=tmp_path / ".prepared.lock")
    lock.acquire()  # the first preparation, still running (this process: alive)
    try:
        for argv in ([str(stories)], [str(stories), "--overwrite", "--vocab-size", "280"]):
            assert prepare_data.main([*argv, "--out", str(out)]) == 1
            assert re.fullmatch(rf"error: {out} is in use by another run \(process {os.getpid()} on .*\); wait for it "
                                r"to end, or choose another --out", one_error(capsys.readouterr().err))
            assert tree(out) == before
        fresh = tmp_path / "fresh"
        RunLock(fresh, path=tmp_path / ".fresh.lock").acquire()
        assert prepare_data.main([str(stories), "--out", str(fresh)]) == 1
        assert "is in use by another run" in one_error(capsys.readouterr().err)
        assert not fresh.exists()
    finally:
        lock.release()
    (tmp_path / ".fresh.lock").unlink()
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    assert "reused" in capsys.readouterr().out and not (tmp_path / ".prepared.lock").exists()


def test_what_a_killed_preparation_left_is_removed_with_a_message(stories, tmp_path, capsys):
    out = tmp_path / "prepared"
    leftover = tmp_path / ".prepared.tmp-4242-abcd"
    leftover.mkdir()
    (leftover / "train.bin").write_bytes(b"\0" * 1000)
    other_runs = tmp_path / ".elsewhere.tmp-4242-abcd"  # another --out's: not ours to remove
    other_runs.mkdir()
    assert prepare_data.main([str(stories), "--out", str(out), "--vocab-size", "300"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"{out}: removed {leftover}, left by a preparation that was killed\n"
    assert not leftover.exists() and other_runs.exists() and load_prepared(out).vocab_size == 300


def test_python_packages_are_prepared_with_whole_files_held_out(tmp_path, monkeypatch, capsys):
    """prepare_data.py python-packages on a fake site-packages: every validation document is a whole module, and no
    module's text is in both splits or twice."""
    from training.data import corpus

    site = tmp_path / "site-packages"
    modules = {}
    for i in range(30):
        path = site / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        modules[path] = f"def f{i}(x):\n    return x + {i}\n" * (5 + i)
        path.write_text(modules[path])
    (site / "pkg0" / "copy_of_mod1.py").write_text(modules[site / "pkg1" / "mod1.py"])
    modules[site / "pkg2" / "mod2.py"] += "EOD = '<|endoftext|>'  # code, not a document boundary\n"
    (site / "pkg2" / "mod2.py").write_text(modules[site / "pkg2" / "mod2.py"])
    monkeypatch.setattr(corpus, "package_dirs", lambda: [site])
    out = tmp_path / "prepared"
    assert prepare_data.main(["python-packages", "--out", str(out), "--vocab-size", "300", "--val-fraction",
                              "0.2"]) == 0
    printed = capsys.readouterr().out
    assert f"from Python sources of the installed packages under {site} (30 files; 1 duplicate left out)" in printed
    data = load_prepared(out)
    texts = {}
    for split in ("train", "val"):
        tokens, starts = np.asarray(data.splits[split].tokens), list(data.splits[split].doc_starts)
        # Each document is an end-of-document token and one file's text (the files are shorter than a piece).
        texts[split] = [data.tokenizer().decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:] + [len(tokens)])]
    assert sorted(texts["train"] + texts["val"]) == sorted(modules.values())
    assert 1 <= len(texts["val"]) < 15
