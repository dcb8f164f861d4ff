"""Tokenizers for prepared data: byte-level BPE (Hugging Face `tokenizers`, trained locally) and plain bytes.

Both share one interface: `encode` (text -> ids), `encode_batch` (texts -> token arrays, in parallel), `decode`,
`vocab_size`, the end-of-document id `eod_id` that begins every document in a prepared stream, and `token_bytes()`:
how many bytes of text each token id stands for, which turns a loss per token into bits per byte. The
end-of-document token counts as one byte: it stands for the separator between documents, as the newline between
files does in the byte-level default corpus.

    tok = BPETokenizer.train(texts, vocab_size=8192)
    ids = tok.encode("def f(x):\\n    return x\\n")
    assert tok.decode(ids) == "def f(x):\\n    return x\\n"
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
BYTE_VOCAB = 256
MIN_BPE_VOCAB = BYTE_VOCAB + 1  # the 256 byte tokens and the end-of-document token
MAX_VOCAB = 2**32  # token ids are stored as uint32 at most
TOKENIZER_FILE = "tokenizer.json"
KINDS = ("bpe", "bytes")


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or loaded; the message names the problem."""


def check_vocab_size(kind: str, vocab_size: int) -> None:
    """The vocabulary sizes each kind can have: bytes is exactly 256; BPE needs the bytes and the end-of-document."""
    if kind not in KINDS:
        raise TokenizerError(f"unknown tokenizer {kind!r}; valid: {', '.join(KINDS)}")
    if kind == "bytes" and vocab_size != BYTE_VOCAB:
        raise TokenizerError(f"--vocab-size {vocab_size}: the bytes tokenizer has exactly {BYTE_VOCAB} tokens")
    if vocab_size < MIN_BPE_VOCAB and kind == "bpe":
        raise TokenizerError(f"--vocab-size {vocab_size} is below {MIN_BPE_VOCAB}: byte-level BPE needs the "
                             f"{BYTE_VOCAB} bytes plus the end-of-document token")
    if vocab_size > MAX_VOCAB:
        raise TokenizerError(f"--vocab-size {vocab_size} is above 2^32: token ids are stored as uint32 at most")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: uint16 up to 65536 tokens, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256). The NUL byte marks the start of a document: text holds none."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    eod_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Union[np.ndarray, list[int]]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Union[np.ndarray, list[int]]) -> bytes:
        """Ids of 256 and more (a model whose vocabulary is larger than the bytes) decode to nothing."""
        ids = np.asarray(ids)
        return bytes(ids[ids < BYTE_VOCAB].astype(np.uint8))

    def token_bytes(self) -> np.ndarray:
        return np.ones(BYTE_VOCAB, dtype=np.int64)

    def fingerprint(self) -> str:
        return "bytes"

    def save(self, directory: Path) -> None:
        """Nothing to write: the bytes tokenizer is fully described by its name."""


class BPETokenizer:
    """Byte-level BPE as GPT-2 defines it: every byte has a token, so any text round-trips exactly."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer, eod_token: str = EOD_TOKEN):
        # eod_token: ours, or the eos token a Hugging Face model directory names (training/data/hf_tokenizer.py).
        eod = hf.token_to_id(eod_token)
        if eod is None:
            raise TokenizerError(f"the tokenizer has no end-of-document token {eod_token!r}")
        # A literal "<|endoftext|>" in the text is text, not a document boundary: boundaries come from the corpus.
        hf.encode_special_tokens = True
        self.hf = hf
        self.eod_id = eod
        self.vocab_size = hf.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, length: Optional[int] = None) -> "BPETokenizer":
        """Learn merges from `texts` (any iterable, consumed once) up to `vocab_size` tokens in all.

        A small corpus can end with fewer tokens than asked: BPE stops when no pair occurs twice.
        """
        check_vocab_size("bpe", vocab_size)
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer, length=length)
        return cls(hf)

    @classmethod
    def load(cls, path: Path, eod_token: str = EOD_TOKEN) -> "BPETokenizer":
        try:
            return cls(HFTokenizer.from_file(str(path)), eod_token)
        except Exception as e:  # the Rust side raises a plain Exception for a missing or malformed file
            if isinstance(e, TokenizerError):
                raise
            raise TokenizerError(f"cannot load the tokenizer {path}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encoded in parallel on all cores (the library's Rust thread pool)."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Union[np.ndarray, list[int]]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        # Byte-level tokens spell each byte as one printable character, so a token's length is its byte count.
        sizes = np.ones(self.vocab_size, dtype=np.int64)
        special = {t.content for t in self.hf.get_added_tokens_decoder().values()}
        for token, i in self.hf.get_vocab().items():
            if token not in special:
                sizes[i] = len(token)
        return sizes

    def fingerprint(self) -> str:
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()[:16]

    def save(self, directory: Path) -> None:
        self.hf.save(str(directory / TOKENIZER_FILE))


Tokenizer = Union[ByteTokenizer, BPETokenizer]


def load_tokenizer(kind: str, directory: Path, eod_token: str = EOD_TOKEN) -> Tokenizer:
    """The tokenizer of kind `kind` saved in `directory` (prepared data or a run's output); `eod_token`: a BPE
    tokenizer's end-of-document token, when it is not ours."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        path = directory / TOKENIZER_FILE
        if not path.exists():
            raise TokenizerError(f"{directory} has no {TOKENIZER_FILE}")
        return BPETokenizer.load(path, eod_token)
    raise TokenizerError(f"unknown tokenizer {kind!r}; valid: {', '.join(KINDS)}")

