"""Text to prepare: which files, their content hash, and their documents read as bounded pieces of UTF-8 text.

A corpus is a text file, a directory of text files, or a named one: `stdlib`, the built-in corpus (this Python's
standard library sources, training/data/text.py's default), or `python-packages`, the Python sources of the installed
packages (site-packages), deduplicated by content, whose validation split is whole files. Every file is a document,
and so is every part of a file between two occurrences of the separator (`<|endoftext|>` by default, as in
TinyStories' text files). Files are read in blocks and long documents are cut into pieces of at most `max_chars`
characters, so memory stays bounded whatever the corpus size.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from training.data.text import stdlib_dir, stdlib_sources, text_files

BLOCK_BYTES = 1 << 20  # read size
BINARY_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file (git's rule)
BUILTIN = "stdlib"
PACKAGES = "python-packages"
NAMED = (BUILTIN, PACKAGES)


class CorpusError(ValueError):
    """Input that cannot be prepared; the one-line message names the file and the problem."""


@dataclass(frozen=True)
class TextCorpus:
    files: list[Path]
    root: Path  # names in the content hash are relative to it, so a moved corpus keeps its hash
    name: str  # default name of the prepared directory
    description: str
    # Validation holds whole files, drawn by a hash of their names, rather than the corpus' last bytes: a corpus
    # in sorted order would otherwise hold out the last packages alone, and cut a file in two.
    val_by_file: bool = False
    # The document separator when none is asked (None: prepare.Settings'); "" makes each file one document.
    separator: Optional[str] = None

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one file, all in one split; a segment begins a document."""

    path: Path
    start: int
    end: int
    split: str  # "train" or "val"


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def _is_utf8(path: Path) -> bool:
    return _decodes(path.read_bytes())


def package_dirs() -> list[Path]:
    """Where the installed packages are: sysconfig's purelib and platlib (often one directory), those that exist."""
    dirs: list[Path] = []
    for key in ("purelib", "platlib"):
        path = Path(sysconfig.get_paths()[key])
        if path.is_dir() and all(path.resolve() != d.resolve() for d in dirs):
            dirs.append(path)
    return dirs


def package_sources() -> TextCorpus:
    """The `python-packages` corpus: every *.py under package_dirs(), each content once (packages vendor the same
    modules: pip, setuptools, torch's third-party copies), empty files, binary and non-UTF-8 files left out."""
    dirs = package_dirs()
    files, seen, duplicates, skipped = [], set(), 0, 0
    for path in (f for root in dirs for f in sorted(root.rglob("*.py")) if f.is_file()):
        data = path.read_bytes()
        if not data:
            continue
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            duplicates += 1
        elif b"\0" in data or not _decodes(data):
            skipped += 1
        else:
            seen.add(digest)
            files.append(path)
    if not files:
        raise CorpusError(f"no Python sources under {', '.join(map(str, dirs)) or 'site-packages'}")
    root = Path(os.path.commonpath(dirs))
    left_out = [f"{duplicates} duplicate{'s' * (duplicates != 1)}"] + [f"{skipped} not UTF-8"] * bool(skipped)
    return TextCorpus(files, root, PACKAGES, f"Python sources of the installed packages under "
                      f"{', '.join(map(str, dirs))} ({len(files)} files; {' and '.join(left_out)} left out)",
                      val_by_file=True, separator="")  # "<|endoftext|>" in a module is code (tokenizers' own)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def resolve(spec: Optional[str]) -> TextCorpus:
    """`spec`: None or 'stdlib' (the built-in corpus), 'python-packages', a text file, or a directory (its text files,
    recursively)."""
    if spec == PACKAGES:
        return package_sources()
    if spec is None or spec == BUILTIN:
        files = stdlib_sources()
        # A few of the standard library's test files are in other encodings on purpose (iso-8859-1, koi8-r).
        utf8 = [f for f in files if _is_utf8(f)]
        skipped = len(files) - len(utf8)
        return TextCorpus(utf8, stdlib_dir(), BUILTIN,
                          f"Python {sysconfig.get_python_version()} standard library sources ({len(utf8)} files"
                          + (f"; {skipped} not in UTF-8 left out)" if skipped else ")"))
    path = Path(spec)
    if not path.exists():
        raise CorpusError(f"input does not exist: {path}")
    if path.is_dir():
        files = [f for f in text_files(path) if not _is_binary(f)]
        if not files:
            raise CorpusError(f"input directory {path} holds no text files")
        return TextCorpus(files, path, path.resolve().name or "data", f"text files under {path} ({len(files)} files)")
    return TextCorpus([path], path.parent, path.stem, f"text file {path}")


def content_hash(corpus: TextCorpus, settings: str) -> str:
    """sha256 of `settings` and of every file's relative name and content: equal hashes, equal prepared data."""
    h = hashlib.sha256(settings.encode())
    for f in corpus.files:
        h.update(f"\0{f.relative_to(corpus.root) if f.is_relative_to(corpus.root) else f.name}\0".encode())
        with open(f, "rb") as fh:
            while block := fh.read(BLOCK_BYTES):
                h.update(block)
    return h.hexdigest()


def _line_start_after(path: Path, offset: int) -> int:
    """The first line start at or after byte `offset` of `path` (a cut there never splits a UTF-8 character)."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        while block := f.read(BLOCK_BYTES):
            i = block.find(b"\n")
            if i >= 0:
                return pos + i + 1
            pos += len(block)
    return pos


def _name_hash(corpus: TextCorpus, path: Path) -> float:
    """A number in [0, 1) from the file's name relative to the corpus' root: the same whatever else is installed."""
    name = str(path.relative_to(corpus.root) if path.is_relative_to(corpus.root) else path)
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def _split_by_file(corpus: TextCorpus, val_fraction: float) -> list[Segment]:
    """Whole files in each split: those whose name hashes below `val_fraction` are validation (about that share of
    the files, spread over the packages; at least one when there are two files)."""
    files = [(f, size) for f in corpus.files if (size := f.stat().st_size) > 0]
    val = {f for f, _ in files if _name_hash(corpus, f) < val_fraction}
    if not val and len(files) > 1:
        val = {min((f for f, _ in files), key=lambda f: _name_hash(corpus, f))}
    return [Segment(f, 0, size, "val" if f in val else "train") for f, size in files]


def split_segments(corpus: TextCorpus, val_fraction: float) -> list[Segment]:
    """The last `val_fraction` of the corpus' bytes (from a line start on) is the validation split; for a corpus
    held out by file, whole files are (`_split_by_file`)."""
    if corpus.val_by_file:
        return _split_by_file(corpus, val_fraction)
    sizes = [f.stat().st_size for f in corpus.files]
    total = sum(sizes)
    threshold = int(total * (1 - val_fraction))
    segments, offset = [], 0
    for f, size in zip(corpus.files, sizes):
        if size == 0:
            continue
        if offset + size <= threshold:
            segments.append(Segment(f, 0, size, "train"))
        elif offset >= threshold:
            segments.append(Segment(f, 0, size, "val"))
        else:
            cut = _line_start_after(f, threshold - offset)
            segments += [Segment(f, 0, cut, "train")] * (cut > 0) + [Segment(f, cut, size, "val")] * (cut < size)
        offset += size
    return segments


def _texts(segment: Segment, progress=None) -> Iterator[str]:
    """The segment's text, decoded block by block; a byte sequence that is not UTF-8 stops with its file and offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(segment.path, "rb") as f:
        f.seek(segment.start)
        pos = segment.start
        while pos < segment.end:
            data = f.read(min(BLOCK_BYTES, segment.end - pos))
            if not data:
                raise CorpusError(f"{segment.path} shrank while it was read (expected {segment.end} bytes)")
            pending = len(decoder.getstate()[0])  # bytes of an unfinished character from the block before
            try:
                text = decoder.decode(data, final=pos + len(data) >= segment.end)
            except UnicodeDecodeError as e:
                offset = pos - pending + e.start
                raise CorpusError(f"{segment.path} is not UTF-8 text (invalid byte at offset {offset}); convert it "
                                  "first, e.g. with iconv -t utf-8") from None
            if "\0" in text:
                raise CorpusError(f"{segment.path} holds a NUL byte near offset {pos}: binary data, not text")
            pos += len(data)
            if progress is not None:
                progress.update(len(data))
            yield text


def _cut(buf: str, limit: int) -> int:
    """Where to cut a long document: before the last newline (else space) before `limit` that follows a non-blank
    character; without one, at `limit`.

    Byte-level BPE's pre-tokenizer always splits between a non-blank character and a blank one, and reads what
    follows the same way whether or not the text before it is there: the cut changes no token.
    """
    for blank in ("\n", " "):
        j = buf.rfind(blank, 0, limit)
        while j > 0 and buf[j - 1].isspace():
            j = buf.rfind(blank, 0, j)
        if j > 0:
            return j
    return limit


def documents(segment: Segment, separator: str, max_chars: int, progress=None) -> Iterator[tuple[str, bool]]:
    """(text, starts_document) pieces of the segment, each at most about `max_chars` characters; empty documents
    (two separators in a row) are left out. The first piece of a segment starts a document."""
    buf, starts = "", True
    for text in _texts(segment, progress):
        buf += text
        while True:
            i = buf.find(separator) if separator else -1
            if i >= 0:
                if i > 0:
                    yield buf[:i], starts
                buf, starts = buf[i + len(separator):], True
                continue
            # Keep the last len(separator) - 1 characters: a separator may straddle this block and the next.
            limit = len(buf) - max(len(separator) - 1, 0)
            if limit > max_chars:
                cut = _cut(buf, min(limit, max_chars))
                yield buf[:cut], starts
                buf, starts = buf[cut:], False
                continue
            break
    if buf:
        yield buf, starts
