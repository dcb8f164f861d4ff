"""Token streams for training: token files, byte-level text, the default stdlib corpus, or synthetic tokens.

Batches are drawn from a generator seeded by (seed, step), so the data position of a run is just its step
number: resuming at step s draws exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from training.files import write_atomic
from training.input_checks import InputError, check_bin_size, check_text, check_token_ids, text_problem

BYTE_VOCAB = 256
TEXT_SUFFIX_SKIP = {".pyc", ".so", ".o", ".a", ".zip", ".gz", ".png", ".jpg", ".bin", ".npy", ".pt"}


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # 1-d integer array (often a read-only memmap)
    vocab_size: Optional[int]  # 256 for byte-level text; None when the file does not say (token files)
    description: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path) -> list[Path]:
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix not in TEXT_SUFFIX_SKIP and "site-packages" not in p.parts:
            files.append(p)
    return files


def _stdlib_sources() -> list[Path]:
    root = stdlib_dir()
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.relative_to(root).parts]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _stdlib_bytes(files: list[Path]) -> tuple[bytes, list[str]]:
    """The default corpus: the standard library's sources; the odd binary one is left out without a word."""
    return b"\n".join(data for data in (f.read_bytes() for f in files) if b"\0" not in data), []


def _file_bytes(path: Path) -> tuple[bytes, list[str]]:
    """A text file given as --data: UTF-8, or an error that says what it is instead."""
    data = path.read_bytes()
    check_text(path, data)
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
        raise InputError(f"--data {root} holds no UTF-8 text file ({len(files)} skipped)")
    return b"\n".join(chunks), warnings


def _cached_bytes(files: list[Path], cache_dir: Path, label: str,
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


def load_corpus(spec: Optional[str], cache_dir: Path, synthetic_vocab: int = 10_000, seed: int = 0,
                warn: Callable[[str], None] = _stderr) -> Corpus:
    """Resolve --data: None (stdlib sources), 'synthetic', a .bin/.npy token file, a text file or a directory.

    A file that cannot be trained on raises InputError naming it (text that is not UTF-8, a .bin file of an odd
    size); a directory's files that are not UTF-8 text are left out with a warning (`warn`) each.
    """
    if spec is None:
        files = _stdlib_sources()
        if not files:
            raise FileNotFoundError(f"no Python sources found under the standard library at {stdlib_dir()}")
        return Corpus(_cached_bytes(files, cache_dir, "stdlib", _stdlib_bytes, warn), BYTE_VOCAB,
                      f"Python {sysconfig.get_python_version()} standard library sources ({len(files)} files, bytes)")
    if spec == "synthetic":
        # Random tokens: no structure to learn, for throughput runs only.
        tokens = np.random.default_rng(seed).integers(0, synthetic_vocab, size=2_000_000, dtype=np.int64)
        return Corpus(tokens.astype(np.uint16 if synthetic_vocab <= 65536 else np.int64), synthetic_vocab,
                      f"synthetic uniform tokens (vocab {synthetic_vocab})")
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"--data path does not exist: {path}")
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise FileNotFoundError(f"--data directory {path} holds no text files")
        return Corpus(_cached_bytes(files, cache_dir, path.name or "data", lambda fs: _directory_bytes(path, fs), warn),
                      BYTE_VOCAB,
                      f"text files under {path} ({len(files)} files, bytes)")
    if path.suffix == ".bin":
        check_bin_size(path)
        return Corpus(np.memmap(path, dtype=np.uint16, mode="r"), None, f"uint16 token file {path}")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{path} must hold a 1-d integer token array, got shape {tokens.shape}, {tokens.dtype}")
        return Corpus(tokens, None, f"token array {path}")
    return Corpus(_cached_bytes([path], cache_dir, path.stem, lambda fs: _file_bytes(path), warn), BYTE_VOCAB,
                  f"text file {path} (bytes)")


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str = "the data") -> None:
    """Every token id must index the embedding: 0 <= id < vocab_size (InputError naming `source` otherwise)."""
    check_token_ids(tokens, vocab_size, source)


def split_train_val(tokens: np.ndarray, context_length: int, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """The last `val_fraction` of the stream is held out; both parts must hold one context window plus one token."""
    need = context_length + 1
    n_val = max(int(len(tokens) * val_fraction), need)
    if len(tokens) - n_val < need:
        raise ValueError(f"the corpus has {len(tokens)} tokens, too short for a training and a validation window "
                         f"of context length {context_length} (needs at least {2 * need})")
    return tokens[:-n_val], tokens[-n_val:]


def batch_at(tokens: np.ndarray, batch_size: int, context_length: int, seed: int, step: int,
             rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (batch_size rows), drawn by (seed, step); rank r gets its contiguous slice.

    Returns (inputs, targets), each (batch_size // world_size, context_length) int64, targets shifted by one.
    """
    if batch_size % world_size:
        raise ValueError(f"global batch {batch_size} is not divisible by world size {world_size}")
    starts = np.random.default_rng((seed, step)).integers(0, len(tokens) - context_length, size=batch_size)
    per_rank = batch_size // world_size
    mine = starts[rank * per_rank:(rank + 1) * per_rank]
    window = np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in mine])
    window = torch.from_numpy(window)
    if torch.device(device).type == "cuda":
        window = window.pin_memory().to(device, non_blocking=True)
    else:
        window = window.to(device)
    return window[:, :-1], window[:, 1:]
