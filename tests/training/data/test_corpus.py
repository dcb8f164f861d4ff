import pytest

from training.data import corpus as text_corpus
from training.data.corpus import CorpusError, Segment, content_hash, documents, resolve, split_segments
from training.data.text import stdlib_dir, stdlib_sources


def whole(path):
    return Segment(path, 0, path.stat().st_size, "train")


def join(pieces):
    """Rebuild the documents from (text, starts_document) pieces."""
    docs = []
    for text, starts in pieces:
        if starts:
            docs.append("")
        docs[-1] += text
    return docs


def test_documents_split_at_the_separator_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(text_corpus, "BLOCK_BYTES", 7)  # separators and characters straddle the reads
    docs = ["first story é", "second ✓ story\nwith two lines", "third"]
    path = tmp_path / "stories.txt"
    path.write_text("<|endoftext|>".join(docs) + "<|endoftext|><|endoftext|>")  # an empty document is left out
    assert join(documents(whole(path), "<|endoftext|>", 1000)) == docs
    assert join(documents(whole(path), "", 1000)) == [path.read_text()], "no separator: the file is one document"


def test_long_documents_are_cut_before_newlines(tmp_path):
    lines = [f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200)]
    path = tmp_path / "long.py"
    path.write_text("".join(lines))
    pieces = list(documents(whole(path), "<|endoftext|>", 100))
    assert len(pieces) > 10 and all(len(t) <= 100 for t, _ in pieces)
    assert [s for _, s in pieces] == [True] + [False] * (len(pieces) - 1)
    assert "".join(t for t, _ in pieces) == path.read_text()
    # Cut before a newline that ends a non-blank line: where byte-level BPE splits anyway.
    assert all(t.startswith("\n") and not prev[-1].isspace() for (prev, _), (t, _) in zip(pieces, pieces[1:]))


def test_non_utf8_and_nul_bytes_name_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(text_corpus, "BLOCK_BYTES", 4)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait\n".encode() + "crème".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1.txt is not UTF-8 text \(invalid byte at offset 16\)"):
        list(documents(whole(bad), "", 1000))
    cut = tmp_path / "cut.txt"
    cut.write_bytes("ok é".encode()[:-1])  # ends inside a character
    with pytest.raises(CorpusError, match="cut.txt is not UTF-8 text"):
        list(documents(whole(cut), "", 1000))
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"text then \0 binary")
    with pytest.raises(CorpusError, match="nul.txt holds a NUL byte"):
        list(documents(whole(nul), "", 1000))


def test_resolve_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("alpha\n")
    (tmp_path / "d" / "sub" / "b.md").write_text("beta\n")
    (tmp_path / "d" / "image.dat").write_bytes(b"\x89PNG\0\0")  # binary: left out
    corpus = resolve(str(tmp_path / "d"))
    assert [f.name for f in corpus.files] == ["a.txt", "b.md"] and corpus.name == "d"
    assert resolve(str(tmp_path / "d" / "a.txt")).files == [tmp_path / "d" / "a.txt"]
    with pytest.raises(CorpusError, match="input does not exist: .*nope"):
        resolve(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no text files"):
        resolve(str(tmp_path / "empty"))


def _is_utf8(path):
    try:
        path.read_bytes().decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_builtin_corpus_leaves_out_files_in_other_encodings(tmp_path, monkeypatch):
    # This Python's standard library: its sources in UTF-8, and only those. Which files are in other encodings (the
    # test suite's iso-8859-1 and koi8-r modules), and whether the test suite is installed at all, depends on the
    # Python version and its packaging, so the files are derived, not named.
    sources = stdlib_sources()
    corpus = resolve(None)
    assert corpus.name == "stdlib" and "standard library" in corpus.description and corpus.root == stdlib_dir()
    assert len(corpus.files) > 100 and all(f.suffix == ".py" for f in corpus.files)
    assert corpus.files == [f for f in sources if _is_utf8(f)]
    skipped = len(sources) - len(corpus.files)
    assert (f"{skipped} not in UTF-8 left out" in corpus.description) == (skipped > 0)
    # And with a file in another encoding known to be there: left out, and counted.
    lib = tmp_path / "lib"
    (lib / "test" / "encoded_modules").mkdir(parents=True)
    (lib / "os.py").write_text("import sys\n")
    (lib / "test" / "encoded_modules" / "module_iso_8859_1.py").write_bytes(
        "# -*- coding: iso-8859-1 -*-\ntest = 'caf\u00e9'\n".encode("iso-8859-1"))
    monkeypatch.setattr(text_corpus, "stdlib_dir", lambda: lib)
    monkeypatch.setattr(text_corpus, "stdlib_sources", lambda: sorted(lib.rglob("*.py")))
    corpus = resolve(None)
    assert corpus.files == [lib / "os.py"] and corpus.root == lib
    assert corpus.description.endswith("(1 files; 1 not in UTF-8 left out)")


def test_validation_split_is_the_tail_from_a_line_start(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 900 + "\n")
    (tmp_path / "b.txt").write_text("line one\n" * 20)  # 180 bytes; the threshold, byte 972 of 1081, is byte 71 of it
    segments = split_segments(resolve(str(tmp_path)), 0.1)
    assert [(s.path.name, s.start, s.end, s.split) for s in segments] == [
        ("a.txt", 0, 901, "train"), ("b.txt", 0, 72, "train"), ("b.txt", 72, 180, "val")]


def test_content_hash_follows_content_names_and_settings(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    corpus = resolve(str(tmp_path))
    first = content_hash(corpus, "settings")
    assert content_hash(resolve(str(tmp_path)), "settings") == first
    assert content_hash(corpus, "other settings") != first
    (tmp_path / "a.txt").write_text("alphb")
    assert content_hash(corpus, "settings") != first


@pytest.fixture
def site_packages(tmp_path, monkeypatch):
    """A fake site-packages of two packages: 40 modules, a vendored copy of one, an empty __init__.py, a module in
    Latin-1, a file that is not *.py; the corpus looks there."""
    site = tmp_path / "site-packages"
    for package in ("alpha", "beta"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        for i in range(20):
            (site / package / f"mod{i}.py").write_text(f"def {package}_{i}(x):\n    return x * {i}\n" * (i + 1))
    (site / "beta" / "_vendor").mkdir()
    (site / "beta" / "_vendor" / "mod3.py").write_bytes((site / "alpha" / "mod3.py").read_bytes())
    (site / "beta" / "latin.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    (site / "beta" / "README.txt").write_text("not a module\n")
    monkeypatch.setattr(text_corpus, "package_dirs", lambda: [site])
    return site


def test_python_packages_drops_duplicates_and_holds_out_whole_files(site_packages):
    corpus = resolve("python-packages")
    assert corpus.name == "python-packages" and corpus.root == site_packages and corpus.val_by_file
    assert len(corpus.files) == 40 and all(f.suffix == ".py" and f.stat().st_size > 0 for f in corpus.files)
    assert site_packages / "beta" / "_vendor" / "mod3.py" not in corpus.files  # alpha/mod3.py's content, once
    assert site_packages / "beta" / "latin.py" not in corpus.files
    assert corpus.description == (f"Python sources of the installed packages under {site_packages} (40 files; "
                                  "1 duplicate and 1 not UTF-8 left out)")
    segments = split_segments(corpus, 0.2)
    assert sorted(s.path for s in segments) == sorted(corpus.files)  # each file once, in one split
    assert all((s.start, s.end) == (0, s.path.stat().st_size) for s in segments), "whole files"
    val = [s.path for s in segments if s.split == "val"]
    assert 2 <= len(val) <= 16 and {p.parent.name for p in val} == {"alpha", "beta"}  # spread over the packages
    assert split_segments(resolve("python-packages"), 0.2) == segments  # the same choice each time
    # The choice depends on each file's own name: another package installed leaves it as it was.
    (site_packages / "gamma").mkdir()
    (site_packages / "gamma" / "extra.py").write_text("z = 1\n")
    assert {s.path for s in split_segments(resolve("python-packages"), 0.2) if s.split == "val"} - {
        site_packages / "gamma" / "extra.py"} == set(val)


def test_python_packages_without_sources_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(text_corpus, "package_dirs", lambda: [tmp_path])
    with pytest.raises(CorpusError, match=f"^no Python sources under {tmp_path}$"):
        resolve("python-packages")
