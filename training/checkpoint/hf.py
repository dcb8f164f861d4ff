"""Hugging Face Llama directories, read and written: what `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads, and what export.py writes, train.py --init-from starts from, and sample.py and evaluate.py open.

    DIR/config.json              LlamaConfig's fields (model/hf_llama.py maps them to and from ModelConfig)
    DIR/model.safetensors        the weights under Llama's names; or model-0000i-of-0000n.safetensors shards with
                                 model.safetensors.index.json (read only: an export writes one file)
    DIR/generation_config.json   bos and eos token ids
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json   when the run had a BPE tokenizer

Only safetensors are read: a pytorch_model.bin is a pickle, which can run code when loaded. An export also keeps,
under config.json's key "flash_lm", the run's configuration, step and checkpoint (transformers keeps the key as an
attribute), so that evaluate.py DIR scores the run's own validation batches.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import torch

from model import ModelConfig
from model import hf_llama
from training.checkpoint.files import CheckpointError
from training.config import SECTIONS

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
OURS = "flash_lm"  # config.json's key for what an export knew of the run


def is_hf_dir(path: Path) -> bool:
    """Whether `path` is a Hugging Face model directory: a config.json naming a model_type (a run's config.json holds
    sections instead)."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a Hugging Face directory; CheckpointError when it is missing or not a JSON object."""
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a Hugging Face model directory: it has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} does not load: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return config


def model_config_of(directory: Path) -> ModelConfig:
    """The architecture of a Hugging Face Llama directory; what ours cannot express is a CheckpointError naming the
    key and value."""
    try:
        return hf_llama.model_config_from_llama(read_config(directory))
    except hf_llama.LlamaConfigError as e:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {e}") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights: model.safetensors, or the shards its index names."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} does not load: {type(e).__name__}: {e}") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    pickled = [p.name for p in directory.glob("pytorch_model*.bin")]
    hint = (f" ({pickled[0]} is not read: a pickle can run code when loaded; transformers' save_pretrained writes "
            f"safetensors)") if pickled else ""
    raise CheckpointError(f"{directory} holds no {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight of a Hugging Face directory under Llama's names, as stored (dtype included), on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            weights.update(load_file(str(path)))
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{path} does not load: {e}") from None
    return weights


def read_model(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The ModelConfig of a Hugging Face Llama directory and its weights as our TransformerLM's state dict."""
    cfg = model_config_of(directory)
    try:
        return cfg, hf_llama.from_llama(read_weights(directory), cfg)
    except hf_llama.LlamaConfigError as e:
        raise CheckpointError(f"{directory}: {e}") from None


def open_hf(directory: Path) -> tuple[Path, dict[str, Any]]:
    """A Hugging Face directory as inference.open_checkpoint's (path, state): the weights file and {"model", "step",
    "config"}; config's model section comes from config.json, the rest from what an export kept (else defaults)."""
    cfg, model = read_model(directory)
    ours = read_config(directory).get(OURS)
    ours = ours if isinstance(ours, dict) else {}
    saved = ours.get("config") if isinstance(ours.get("config"), dict) else {}
    # Only the fields this version knows: a run of a later version may have more.
    sections = {name: {k: v for k, v in values.items() if k in {f.name for f in fields(SECTIONS[name])}}
                for name, values in saved.items() if name in SECTIONS and name != "model" and isinstance(values, dict)}
    path = directory / WEIGHTS_FILE if (directory / WEIGHTS_FILE).is_file() else directory / INDEX_FILE
    return path, {"model": model, "step": ours.get("step", 0), "config": {**sections, "model": cfg.to_dict()}}


def write_hf(directory: Path, state: dict[str, torch.Tensor], cfg: ModelConfig, eod_id: Optional[int],
             tokenizer: Optional[tuple[Path, str]] = None, ours: Optional[dict[str, Any]] = None) -> list[Path]:
    """Write our TransformerLM state dict `state` of `cfg` as a Hugging Face Llama directory into the existing
    `directory` (export.py's temporary one), fsynced; the files written.

    eod_id: the end-of-document token, bos and eos (None: the data had none); tokenizer: (tokenizer.json, its
    end-of-document token) to copy; ours: config.json's "flash_lm" entry."""
    from safetensors.torch import save_file

    from training.data.hf_tokenizer import write_hf_tokenizer

    tensors = {name: t.detach().cpu().contiguous() for name, t in hf_llama.to_llama(state, cfg).items()}
    dtype = tensors["model.embed_tokens.weight"].dtype
    config = {"architectures": [hf_llama.ARCHITECTURE], "model_type": "llama", **hf_llama.llama_config(cfg),
              "bos_token_id": eod_id, "eos_token_id": eod_id, "pad_token_id": None,
              "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True, **({OURS: ours} if ours else {})}
    generation = {k: eod_id for k in ("bos_token_id", "eos_token_id") if eod_id is not None}
    written = [directory / WEIGHTS_FILE, directory / CONFIG_FILE, directory / GENERATION_FILE]
    save_file(tensors, str(written[0]), metadata={"format": "pt"})  # "pt": transformers' check of the origin
    for path, content in zip(written[1:], (config, generation)):
        path.write_text(json.dumps(content, indent=2) + "\n")
    if tokenizer is not None:
        written += write_hf_tokenizer(tokenizer[0], tokenizer[1], directory, cfg.context_length)
    for path in written:  # on disk before export.py renames the directory into place
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return written
