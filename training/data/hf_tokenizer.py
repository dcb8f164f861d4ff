"""The tokenizer of a Hugging Face model directory: `tokenizer.json` (the `tokenizers` library's file, which our BPE
writes as it is) beside `tokenizer_config.json` and `special_tokens_map.json`, which name its special tokens for
`transformers.AutoTokenizer`.

Our end-of-document token begins every document of a prepared stream, so a model of ours sees it before each
document and predicts it after one: it is both the bos and the eos token. A directory from elsewhere names its eos
token, which then plays the end of document here (sampling stops at it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from training.data.tokenizer import EOD_TOKEN, TOKENIZER_FILE, BPETokenizer, TokenizerError

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


def write_hf_tokenizer(tokenizer_file: Path, eod_token: str, directory: Path, max_length: int) -> list[Path]:
    """A copy of `tokenizer_file` and the two files naming `eod_token` as bos and eos, in `directory`; the paths."""
    special = {"bos_token": eod_token, "eos_token": eod_token}
    # PreTrainedTokenizerFast: the generic class for a tokenizer.json; a model-specific class (LlamaTokenizerFast)
    # would add its own bos token and prefix space, which ours does not have.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    written = [directory / TOKENIZER_FILE, directory / TOKENIZER_CONFIG, directory / SPECIAL_TOKENS_MAP]
    written[0].write_bytes(tokenizer_file.read_bytes())
    for path, content in zip(written[1:], (config, special)):
        path.write_text(json.dumps(content, indent=2) + "\n")
    return written


def _token_text(value: Any) -> Optional[str]:
    """A special token as these files spell it: a string, or an object with its "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def eos_token_of(directory: Path) -> Optional[str]:
    """The eos token `directory`'s tokenizer_config.json (else special_tokens_map.json) names, or None."""
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise TokenizerError(f"{path} is not JSON: {e}") from None
        token = _token_text(data.get("eos_token")) if isinstance(data, dict) else None
        if token is not None:
            return token
    return None


def load_hf_tokenizer(directory: Path) -> Optional[BPETokenizer]:
    """The tokenizer of a Hugging Face directory, its eos token as the end of document; None without tokenizer.json."""
    if not (directory / TOKENIZER_FILE).is_file():
        return None
    return BPETokenizer.load(directory / TOKENIZER_FILE, eos_token_of(directory) or EOD_TOKEN)


def hf_data_note(directory: Path) -> Optional[dict[str, Any]]:
    """What a run's data.json says of its tokenizer (training/data/record.py), for a Hugging Face directory, which
    names no data: its tokenizer's kind, fingerprint and end of document. None when it has no tokenizer.json."""
    tokenizer = load_hf_tokenizer(directory)
    if tokenizer is None:
        return None
    return {"data": str(directory), "corpus": None, "tokenizer": tokenizer.kind,
            "tokenizer_fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "eod_token": eos_token_of(directory) or EOD_TOKEN}
