"""train.py --init-from DIR: a run that starts from the weights of a Hugging Face Llama directory (a local path, as
export.py writes or transformers' save_pretrained does; nothing is downloaded).

The model section of the run's configuration comes from DIR's config.json (model/hf_llama.py). A flag may still set
what leaves the weights as they are (--context-length, --window, --window-pattern, --attn-softcap); one that would
change them (--d-model, --n-heads, --rope-theta, --vocab-size, ...) is refused, naming both values. The weights are
loaded once the model is built, before the step wraps it. DIR's tokenizer, when it has a tokenizer.json, must be the
data's: prepared data of another tokenizer, or text read as bytes, is refused; token files (.bin/.npy) are taken
as its tokens, and the run records it, so that sample.py and evaluate.py decode with it. A resumed run continues from
its own checkpoint: --init-from is not read again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from model import ModelConfig
from training.checkpoint import hf
from training.checkpoint.files import CheckpointError
from training.cli import apply
from training.config import Config, ConfigError, flag_of
from training.data.hf_tokenizer import load_hf_tokenizer
from training.data.source import DataError, DataSource
from training.data.tokenizer import BPETokenizer, TokenizerError

# Model fields a flag may change in a run started from a directory: the weights stay the same shapes and meaning.
KEEPS_WEIGHTS = ("context_length", "window", "window_pattern", "attn_softcap")


def init_directory(config: Config) -> Optional[Path]:
    """The directory a new run starts from; None without --init-from, or when resuming (its checkpoint wins)."""
    if not config.run.init_from or config.run.resume:
        return None
    directory = Path(config.run.init_from)
    if not directory.is_dir():
        raise CheckpointError(f"--init-from {directory}: no such directory (a local Hugging Face model directory; "
                              "nothing is downloaded)")
    if not hf.is_hf_dir(directory):
        raise CheckpointError(f"--init-from {directory} is not a Hugging Face model directory (no {hf.CONFIG_FILE} "
                              "naming a model_type)")
    return directory


def init_config(config: Config, explicit: frozenset[str]) -> Config:
    """`config` with its model section from --init-from's config.json (unchanged without it or when resuming);
    ConfigError for a flag that contradicts it, CheckpointError for a directory ours cannot start from."""
    directory = init_directory(config)
    if directory is None:
        return config
    theirs, asked = hf.model_config_of(directory), config.model
    if "vocab_size" in explicit and config.data.vocab_size not in (None, theirs.vocab_size):
        raise ConfigError(f"--vocab-size {config.data.vocab_size} differs from --init-from {directory}, whose "
                          f"config.json has {theirs.vocab_size}: the model comes from it (drop the flag)")
    values = theirs.to_dict()
    for f in dataclasses.fields(ModelConfig):
        name, mine = f.name, getattr(asked, f.name)
        if name not in explicit or name == "vocab_size":
            continue
        if name in KEEPS_WEIGHTS:
            values[name] = mine
        elif mine != values[name]:
            raise ConfigError(f"{flag_of('model', name)} {mine} differs from --init-from {directory}, whose "
                              f"config.json has {values[name]}: the model comes from it (drop the flag)")
    return apply(config, {("model", name): value for name, value in values.items()})


@dataclass(frozen=True)
class Initialisation:
    """A new run's start from a Hugging Face directory: its weights and, when it has one, its tokenizer."""

    directory: Path
    tokenizer: Optional[BPETokenizer]

    @classmethod
    def of(cls, config: Config) -> Optional["Initialisation"]:
        """None without --init-from or when resuming."""
        directory = init_directory(config)
        if directory is None:
            return None
        hf.weight_files(directory)  # their absence said now, before the run's directory changes
        try:
            return cls(directory, load_hf_tokenizer(directory))
        except TokenizerError as e:
            raise DataError(f"--init-from {directory}: {e}") from None

    def check_data(self, source: DataSource, spec: Optional[str]) -> None:
        """The data must be tokens of the directory's tokenizer, when it has one (token files are taken as such)."""
        if self.tokenizer is None:
            return
        ours, name = source.identity, spec or "the built-in corpus"
        where = f"--init-from {self.directory}'s tokenizer.json (vocabulary {self.tokenizer.vocab_size})"
        if ours.get("kind") == "bytes":
            raise DataError(f"{name} is read as UTF-8 bytes, but the model reads tokens of {where}: pass its tokens "
                            "as a .bin/.npy file")
        if ours.get("kind") == "prepared" and ours["tokenizer_fingerprint"] != self.tokenizer.fingerprint():
            raise DataError(f"{name} is tokenized with another tokenizer ({ours['tokenizer']}, vocabulary "
                            f"{ours['vocab_size']}) than {where}")

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module) -> None:
        """The directory's weights into `model` (built from init_config's model, on its device)."""
        _, state = hf.read_model(self.directory)
        model.load_state_dict(state)

    def describe(self) -> str:
        tokenizer = "" if self.tokenizer is None else f" and its tokenizer (vocabulary {self.tokenizer.vocab_size})"
        return f"initial weights from {self.directory}{tokenizer}"
