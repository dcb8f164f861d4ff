"""Evaluate a checkpoint: `python evaluate.py runs/train` prints loss, perplexity and bits per byte.

By default it scores the batches the run scored for val_loss (its validation split, --eval-batches batches of
--batch-size drawn by its seed), so the figures repeat the run's last logged val_loss and val_bpb. --full scores
every token of the split once instead; --data evaluates on other data (a prepared directory tokenized with the
run's tokenizer, or what train.py's --data reads); --split train the training split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from attention import UnknownBackendError
from training.checkpoint.files import CheckpointError
from training.checkpoint.inference import load_model, open_checkpoint, run_config_of
from training.cli import OneLineParser, add_field
from training.config import ConfigError, default_device, resolve
from training.data import DataError, open_source
from training.data.record import check_data_unchanged, check_same_tokenizer
from training.data.sampling import Sampler, sequential_batches
from training.data.tokenizer import TokenizerError
from training.evaluation import Evaluation, evaluate
from training.precision import autocast
from training.progress import Progress
from training.run.failures import out_of_memory_message, run_main

EXPECTED = (ConfigError, CheckpointError, DataError, TokenizerError, UnknownBackendError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run's output directory (its newest checkpoint) or a checkpoint file")
    p.add_argument("--data", help="data to evaluate on, as train.py's --data; default: the run's")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split of the data")
    p.add_argument("--full", action="store_true", help="every token of the split once, in consecutive windows")
    p.add_argument("--batch-size", type=int, help="sequences per batch; default: the run's")
    p.add_argument("--eval-batches", type=int, help="batches to score (without --full); default: the run's")
    for name in ("dtype", "attn", "device"):
        add_field(p, "execution", name, shown=True, dest=name, help=f"as train.py's --{name}; default: "
                  + ("bf16 on CUDA, fp32 on the CPU" if name == "dtype" else "the run's" if name == "attn" else
                     "cuda if available, else cpu"))
    add_field(p, "run", "allow_pickle", shown=True, dest="allow_pickle")
    add_field(p, "data", "data_changed", shown=True, dest="data_changed",
              help="evaluate on the run's --data although it is no longer the data the run trained on")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return p


def run_evaluation(args: argparse.Namespace) -> tuple[Evaluation, dict]:
    for name in ("batch_size", "eval_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    path, state = open_checkpoint(Path(args.run), allow_pickle=bool(args.allow_pickle))
    run = run_config_of(state)
    asked = run.replace(execution={"attn": args.attn or run.execution.attn, "dtype": args.dtype,
                                   "device": args.device, "compile": False, "cuda_graph": False, "parallel": "none",
                                   "fp8": "off", "activation_checkpointing": False, "recompute": "full",
                                   "grad_accum_steps": 1},
                        data={"batch_size": args.batch_size or run.data.batch_size, "pack_documents": False})
    config = resolve(asked, training=False, world_size=1).config
    device = torch.device(config.execution.device)
    spec = args.data if args.data is not None else run.data.data
    # A run's byte cache lives next to its output directory (train.py's <out>/../.token_cache).
    source = open_source(spec, config.model.context_length, path.parent.parent / ".token_cache",
                         run.data.vocab_size, run.run.seed)
    check_same_tokenizer(path.parent, source, spec)
    if args.data is None:  # the run's own data: still what it trained on?
        check_data_unchanged(path.parent, source, bool(args.data_changed))
    if source.vocab_size is not None and source.vocab_size > config.model.vocab_size:
        raise DataError(f"{spec or 'the built-in corpus'} has a vocabulary of {source.vocab_size} tokens, the "
                        f"checkpoint's model {config.model.vocab_size}: it was trained on other tokens")
    model = load_model(path, state, config.model, config.execution.attn, device).eval()
    tokens = source.split(args.split)
    batch_size = config.data.batch_size
    if args.full:
        batches = sequential_batches(tokens, batch_size, config.model.context_length, device)
        total = -(-(len(tokens) - 1) // config.model.context_length // batch_size)
    else:
        total = args.eval_batches or run.run.eval_batches
        batches = Sampler(source, batch_size, config.model.context_length, run.run.seed, device=device).val(
            total, args.split)
    token_bytes = None if source.token_bytes is None else torch.as_tensor(source.token_bytes, device=device)
    progress = Progress(total, "evaluate", unit="batch", every_s=10.0)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        progress.update(1)
        with autocast(device, config.execution.dtype):
            return model(x, y)

    result = evaluate(loss, batches, token_bytes)
    progress.close()
    return result, {"checkpoint": str(path), "step": state["step"], "data": source.description, "split": args.split}


def report(args: argparse.Namespace) -> int:
    result, about = run_evaluation(args)
    figures = {"loss": result.loss, "perplexity": result.perplexity, "bpb": result.bpb, "tokens": result.tokens}
    if args.json:
        print(json.dumps({**about, **figures}))
        return 0
    bpb = "unknown bits per byte (token data)" if result.bpb is None else f"{result.bpb:.4f} bits per byte"
    print(f"{about['checkpoint']} (step {about['step']}), {about['split']} split of {about['data']}:")
    print(f"loss {result.loss:.4f}, perplexity {result.perplexity:.2f}, {bpb} ({result.tokens:,} tokens)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or default_device())
    return run_main(lambda: report(args), EXPECTED,
                    memory=lambda e: out_of_memory_message(e, device, "this --batch-size", "--batch-size"))


if __name__ == "__main__":
    sys.exit(main())
