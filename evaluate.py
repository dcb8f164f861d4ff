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

from attention import UnknownBackendError, backend_names
from model import ModelConfig, TransformerLM
from training import checkpoint_files, cli, sharded_checkpoint
from training.dataset import DataMismatchError, check_same_tokenizer, load_run_data
from training.distributed import DistContext
from training.evaluation import Evaluation, evaluate, sampled_batches, sequential_batches
from training.precision import DTYPES, autocast
from training.prepared import PreparedDataError
from training.tokenizer import TokenizerError


class EvaluationError(RuntimeError):
    """A checkpoint or data that cannot be evaluated; main() prints the one-line message and exits 1."""

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run's output directory (its newest checkpoint) or a checkpoint file")
    p.add_argument("--data", help="data to evaluate on, as train.py's --data; default: the run's")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which split of the data")
    p.add_argument("--full", action="store_true", help="every token of the split once, in consecutive windows")
    p.add_argument("--batch-size", type=int, help="sequences per batch; default: the run's")
    p.add_argument("--eval-batches", type=int, help="batches to score (without --full); default: the run's")
    p.add_argument("--dtype", choices=list(DTYPES), help="compute precision; default: the run's")
    p.add_argument("--attn", help="attention backend; default: the run's")
    cli.add_device_flag(p)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return p


def load_checkpoint(run: Path) -> tuple[Path, dict]:
    """(path, state) of a checkpoint file, or of the newest checkpoint of a run directory that loads."""
    if run.is_dir():
        if not checkpoint_files.candidates(run):
            if not (run / sharded_checkpoint.DCP_DIR_NAME).exists():
                raise EvaluationError(f"no checkpoint in {run}")
            raise EvaluationError(f"{run} holds only a sharded FSDP checkpoint; make one file of it with "
                                  f"`python -m training.consolidate {run / sharded_checkpoint.DCP_DIR_NAME} "
                                  f"{run}/consolidated.pt --model-only` and pass that file")
        try:
            return checkpoint_files.load_newest(run)
        except checkpoint_files.CheckpointError as e:
            raise EvaluationError(str(e)) from None
    if not run.is_file():
        raise EvaluationError(f"no checkpoint at {run}")
    try:
        return run, checkpoint_files.load_named(run)
    except checkpoint_files.CheckpointError as e:
        raise EvaluationError(str(e)) from None


def run_evaluation(args: argparse.Namespace) -> tuple[Evaluation, dict]:
    path, state = load_checkpoint(Path(args.run))
    saved = state["args"]
    attn = args.attn or state["model_config"]["attn"]
    if attn not in backend_names():
        raise EvaluationError(f"unknown --attn {attn!r}; valid: {', '.join(backend_names())}")
    cfg = ModelConfig(**{**state["model_config"], "attn": attn})
    spec = args.data if args.data is not None else saved.get("data")
    # A run's byte cache lives next to its output directory (train.py's <out>/../.token_cache).
    data = load_run_data(spec, path.parent.parent / ".token_cache", cfg.context_length,
                         synthetic_vocab=saved.get("vocab_size") or 10_000, seed=saved["seed"])
    check_same_tokenizer(path.parent, data, spec)
    if data.vocab_size is not None and data.vocab_size > cfg.vocab_size:
        raise DataMismatchError(f"{spec or 'the built-in corpus'} has a vocabulary of {data.vocab_size} tokens, the "
                                f"checkpoint's model {cfg.vocab_size}: it was trained on other tokens")

    device = torch.device(args.device)
    with device:
        model = TransformerLM(cfg)
    model.load_state_dict(state["model"])
    model.eval()
    tokens = data.val if args.split == "val" else data.train
    batch_size = args.batch_size or saved["batch_size"]
    if args.full:
        batches = sequential_batches(tokens, batch_size, cfg.context_length, device)
    else:
        batches = sampled_batches(tokens, batch_size, cfg.context_length, args.eval_batches or saved["eval_batches"],
                                  saved["seed"], DistContext(device=device))
    token_bytes = None if data.token_bytes is None else torch.as_tensor(data.token_bytes, device=device)
    precision = args.dtype or saved.get("dtype", "fp32")

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(device, precision):
            return model(x, y)

    result = evaluate(loss, batches, token_bytes)
    return result, {"checkpoint": str(path), "step": state["step"], "data": data.description, "split": args.split}

def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "eval_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cli.check_device(parser, args.device)
    try:
        result, about = run_evaluation(args)
    except (EvaluationError, DataMismatchError, PreparedDataError, TokenizerError, FileNotFoundError, ValueError,
            UnknownBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    figures = {"loss": result.loss, "perplexity": result.perplexity, "bpb": result.bpb, "tokens": result.tokens}
    if args.json:
        print(json.dumps({**about, **figures}))
        return 0
    bpb = "unknown bits per byte (token data)" if result.bpb is None else f"{result.bpb:.4f} bits per byte"
    print(f"{about['checkpoint']} (step {about['step']}), {about['split']} split of {about['data']}:")
    print(f"loss {result.loss:.4f}, perplexity {result.perplexity:.2f}, {bpb} ({result.tokens:,} tokens)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
