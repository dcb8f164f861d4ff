"""Text as bytes: the built-in corpus (this Python's standard library sources), a text file, or a directory of them.

Each byte is a token (vocabulary 256, one byte of text per token). The bytes are cached as a uint16 token file in
the cache directory, keyed by the files' names, sizes and modification times, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from training.data.source import DataError, DataSource, content_crc, split_train_val
from training.data.tokenizer import BYTE_VOCAB
from training.run.files import write_atomic

SKIPPED_SUFFIXES = {".pyc", ".so", ".o", ".a", ".zip", ".gz", ".png", ".jpg", ".bin", ".npy", ".pt", ".safetensors"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(root: Path) -> list[Path]:
    """The files under `root` that may hold text, sorted (installed packages and binary suffixes left out)."""
    return [p for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix not in SKIPPED_SUFFIXES and "site-packages" not in p.parts]


def stdlib_sources() -> list[Path]:
    root = stdlib_dir()
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.relative_to(root).parts]


def text_problem(data: bytes) -> Optional[str]:
    """Why `data` is not UTF-8 text, in a few words; None if it is."""
    if not data:
        return "is empty"
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "is UTF-32 text, not UTF-8 (it starts with a UTF-32 byte-order mark); convert it to UTF-8"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "is UTF-16 text, not UTF-8 (it starts with a UTF-16 byte-order mark); convert it to UTF-8"
    head = data[:4096]
    if head.count(b"\0") > len(head) // 4 and (head[0::2].count(0) == 0 or head[1::2].count(0) == 0):
        # ASCII text in UTF-16 without a byte-order mark: every other byte is 0.
        return "looks like UTF-16 text, not UTF-8 (every other byte is 0); convert it to UTF-8"
    if b"\0" in data:
        return "is binary, not text (it holds NUL bytes)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    return None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _stdlib_bytes(files: list[Path]) -> tuple[bytes, list[str]]:
    """The default corpus: the standard library's sources; the odd binary one is left out without a word."""
    return b"\n".join(data for data in (f.read_bytes() for f in files) if b"\0" not in data), []


def _file_bytes(path: Path) -> tuple[bytes, list[str]]:
    data = path.read_bytes()
    problem = text_problem(data)
    if problem is not None:
        raise DataError(f"--data {path} {problem}")
    return data, []


def _directory_bytes(root: Path, files: list[Path]) -> tuple[bytes, list[str]]:
    """The UTF-8 text files under `root`, joined by newlines, and a warning for each file left out."""
    chunks, warnings = [], []
    for f in files:
        data = f.read_bytes()
        problem = text_problem(data)
        if problem is None:
            chunks.append(data)
        elif data:  # an empty file adds nothing: no need to say so
            warnings.append(f"warning: --data {root}: skipping {f}, which {problem}")
    if not chunks:
        raise DataError(f"--data {root} holds no UTF-8 text file ({len(files)} skipped)")
    return b"\n".join(chunks), warnings


def cached_bytes(files: list[Path], cache_dir: Path, label: str,
                 read: Callable[[list[Path]], tuple[bytes, list[str]]],
                 warn: Callable[[str], None] = _stderr) -> np.ndarray:
    """Byte-level tokens of `files`, cached as uint16 .bin keyed by the files' names, sizes and mtimes.

    `read` returns the bytes and a warning per file it left out; the warnings are kept next to the cache (`.skipped`)
    and repeated whenever the cache is used. Runs that build the same cache at once each write their own temporary
    file and rename it into place: each reads a complete cache, whichever rename came last.
    """
    key = hashlib.sha1()
    for f in files:
        st = f.stat()
        key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    path = cache_dir / f"{label}-{key.hexdigest()[:12]}.bin"
    skipped = path.with_suffix(".skipped")
    if not path.exists():
        data, warnings = read(files)
        tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        cache_dir.mkdir(parents=True, exist_ok=True)
        if warnings:
            write_atomic(skipped, lambda f: f.write("".join(w + "\n" for w in warnings).encode()))
        write_atomic(path, lambda f: tokens.tofile(f))  # after the warnings: a cache is never without them
    if skipped.exists():
        for line in skipped.read_text().splitlines():
            warn(line)
    return np.memmap(path, dtype=np.uint16, mode="r")


def open_text(spec: Optional[str], cache_dir: Path, context_length: int,
              warn: Callable[[str], None] = _stderr) -> DataSource:
    """None: the built-in corpus; else a text file or a directory of text files (its files that are not UTF-8 text
    are left out with a warning each)."""
    if spec is None:
        files = stdlib_sources()
        if not files:
            raise DataError(f"no Python sources found under the standard library at {stdlib_dir()}")
        tokens = cached_bytes(files, cache_dir, "stdlib", _stdlib_bytes, warn)
        description = f"Python {sysconfig.get_python_version()} standard library sources ({len(files)} files, bytes)"
    elif Path(spec).is_dir():
        root = Path(spec)
        files = text_files(root)
        if not files:
            raise DataError(f"--data directory {root} holds no text files")
        tokens = cached_bytes(files, cache_dir, root.name or "data", lambda fs: _directory_bytes(root, fs), warn)
        description = f"text files under {root} ({len(files)} files, bytes)"
    else:
        path = Path(spec)
        tokens = cached_bytes([path], cache_dir, path.stem, lambda fs: _file_bytes(path), warn)
        description = f"text file {path} (bytes)"
    train, val = split_train_val(tokens, context_length, name=description)
    return DataSource(train, val, description, BYTE_VOCAB, np.ones(BYTE_VOCAB, dtype=np.int64),
                      identity={"kind": "bytes", "source": spec or "builtin", "fingerprint": content_crc(tokens)})
