"""Train a from-scratch Transformer LM: `python train.py --attn flash --dtype bf16`.

Logs loss, learning rate, gradient norm, step time, tokens/s, MFU and memory to the console (a progress bar),
to `<out>/metrics.jsonl` and to Weights & Biases; checkpoints atomically to `<out>/checkpoint.pt`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attention import UnknownBackendError, backend_names
from model import PRESETS, ModelConfig, TransformerLM, config_for
from training import checkpoint
from training.data import batch_at, check_vocab, load_corpus, split_train_val
from training.logger import METRICS_FILE, MetricsLogger
from training.metrics import cuda_memory_gib, flops_per_token, mfu
from training.schedule import lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(RuntimeError):
    """A run that must stop with a message (bad input, NaN loss); main() prints it and exits 1."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--size", default="small", help=f"size preset: {', '.join(PRESETS)}")
    m.add_argument("--d-model", type=int, help="override the preset's d_model")
    m.add_argument("--n-layers", type=int, help="override the preset's number of blocks")
    m.add_argument("--n-heads", type=int, help="override the preset's number of attention heads")
    m.add_argument("--d-ff", type=int, help="override the preset's SwiGLU hidden size")
    m.add_argument("--vocab-size", type=int, help="vocabulary; default 256 for byte-level text, else 10000")
    m.add_argument("--context-length", type=int, default=512, help="tokens per training sequence")
    m.add_argument("--attn", default="sdpa", help="attention backend from the registry (see README)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    o.add_argument("--steps", type=int, default=2000, help="optimizer steps in total")
    o.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    o.add_argument("--min-lr", type=float, default=6e-5, help="learning rate at the end of the cosine decay")
    o.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    o.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm; 0 disables")
    o.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="compute precision: bf16/fp16 autocast with fp32 master weights (fp16 adds a grad scaler)")
    o.add_argument("--compile", action="store_true", help="torch.compile the model")
    r = p.add_argument_group("run")
    r.add_argument("--data", help="token file (.bin uint16 / .npy), text file, directory of text files, or "
                                  "'synthetic'; default: this Python's standard library sources as bytes")
    r.add_argument("--eval-every", type=int, default=200, help="validation loss every N steps (0: only at the end)")
    r.add_argument("--eval-batches", type=int, default=10, help="validation batches per evaluation")
    r.add_argument("--log-every", type=int, default=10, help="log metrics every N steps")
    r.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps (0: only at the end)")
    r.add_argument("--out", default="runs/train", help="output directory (metrics, checkpoint, W&B run)")
    r.add_argument("--resume", action="store_true", help=f"continue from <out>/{checkpoint.CHECKPOINT_NAME}")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    r.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    r.add_argument("--wandb", choices=["offline", "online", "disabled"], default="offline",
                   help="W&B mode; offline writes <out>/wandb for a later `wandb sync`")
    r.add_argument("--wandb-project", default="flash-lm", help="W&B project name")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad flags at once, naming the problem (argparse exits with status 2)."""
    if args.size not in PRESETS:
        p.error(f"unknown --size {args.size!r}; valid: {', '.join(PRESETS)}")
    if args.attn not in backend_names():
        p.error(f"unknown --attn {args.attn!r}; valid: {', '.join(backend_names())}")
    for name in ("batch_size", "steps", "context_length", "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.dtype == "fp16" and not args.device.startswith("cuda"):
        p.error("--dtype fp16 needs a CUDA device (the gradient scaler is CUDA-only); use bf16 or fp32 on the CPU")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} asked for, but no CUDA GPU is visible; use --device cpu")


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    try:
        return config_for(args.size, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          d_ff=args.d_ff, vocab_size=vocab_size, context_length=args.context_length, attn=args.attn)
    except ValueError as e:
        raise TrainingError(str(e)) from None


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    # Decay matrices only: norm gains are scales, decaying them towards 0 fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: contextlib.AbstractContextManager):
    with autocast:
        logits = model(x)  # (batch, seq, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, val_tokens, args, autocast, device) -> float:
    model.eval()
    # Fixed batches (seeded by index, not by training step) so every evaluation sees the same data.
    losses = [lm_loss(model, *batch_at(val_tokens, args.batch_size, args.context_length, args.seed, i,
                                       device=device), autocast).item() for i in range(args.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


class StopRequest:
    """First Ctrl-C asks the loop to checkpoint and stop at the next step boundary; a second one aborts."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: saving a checkpoint at the end of this step (press again to abort)", file=sys.stderr)

    def restore(self):
        signal.signal(signal.SIGINT, self._previous)


def save_checkpoint(path: Path, model, optimizer, scaler, step: int, cfg: ModelConfig, args) -> None:
    checkpoint.save_atomic({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,  # also the data position: batches are drawn by (seed, step)
        "rng": checkpoint.rng_state(),
        "model_config": cfg.to_dict(),
        "args": vars(args),
    }, path)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint we resume from, so metrics.jsonl reads as one run."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(r + "\n" for r in rows))


def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    out = Path(args.out)
    torch.manual_seed(args.seed)

    corpus = load_corpus(args.data, cache_dir=out.parent / ".token_cache", seed=args.seed,
                         synthetic_vocab=args.vocab_size or 10_000)
    vocab_size = args.vocab_size or corpus.vocab_size or 10_000
    check_vocab(corpus.tokens, vocab_size)
    train_tokens, val_tokens = split_train_val(corpus.tokens, args.context_length)
    cfg = model_config(args, vocab_size)

    model = TransformerLM(cfg).to(device)
    optimizer = make_optimizer(model, args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    ckpt_path = out / checkpoint.CHECKPOINT_NAME
    start_step = 0
    if args.resume:
        state = checkpoint.load(ckpt_path)
        if state["model_config"] != cfg.to_dict():
            diff = {k: (v, cfg.to_dict()[k]) for k, v in state["model_config"].items() if cfg.to_dict()[k] != v}
            raise TrainingError(f"checkpoint {ckpt_path} was written for another model: (saved, asked) {diff}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step = state["step"]
        checkpoint.set_rng_state(state["rng"])
        truncate_metrics(out / METRICS_FILE, start_step)
    step_model = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32")

    n_params, n_non_embed = model.num_params(), model.num_params(non_embedding=True)
    tokens_per_step = args.batch_size * args.context_length
    print(f"model: {n_params / 1e6:.1f}M parameters ({n_non_embed / 1e6:.1f}M non-embedding), "
          f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, attention {cfg.attn!r}, "
          f"{args.dtype} on {device}")
    print(f"data: {corpus.description}: {len(train_tokens):,} train / {len(val_tokens):,} val tokens, "
          f"vocab {vocab_size}; {flops_per_token(cfg) / 1e9:.2f} GFLOP per token")

    logger = MetricsLogger(out, args.wandb, args.wandb_project, {**vars(args), "model": cfg.to_dict(),
                           "params": n_params, "params_non_embedding": n_non_embed}, append=args.resume)
    stop = StopRequest()
    step, summary, exit_code = start_step, {}, 1
    window_start, window_steps = time.perf_counter(), 0
    last_good_ckpt: Optional[int] = start_step if args.resume else None
    bar = tqdm(total=args.steps, initial=start_step, desc="train", dynamic_ncols=True, disable=None)
    try:
        while step < args.steps:
            lr = lr_at(step, args.lr, args.min_lr, args.warmup_steps, args.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = batch_at(train_tokens, args.batch_size, args.context_length, args.seed, step, device=device)
            loss = lm_loss(step_model, x, y, autocast)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0
                                                       else float("inf"))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            bar.update(1)

            is_last = step == args.steps
            eval_now = is_last or (args.eval_every > 0 and step % args.eval_every == 0)
            log_now = step % args.log_every == 0 or eval_now or stop.requested
            ckpt_now = is_last or stop.requested or (args.ckpt_every > 0 and step % args.ckpt_every == 0)
            if not (log_now or ckpt_now):
                continue
            loss_value = loss.item()  # synchronises; only on log/checkpoint steps
            if not math.isfinite(loss_value):
                where = f"{ckpt_path} (step {last_good_ckpt})" if last_good_ckpt is not None else "none was written"
                raise TrainingError(f"loss became {loss_value} at step {step}; stopping. Last good checkpoint: {where}")
            metrics = {"loss": loss_value, "lr": lr, "grad_norm": grad_norm.item()}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - window_start
            metrics["step_ms"] = 1000 * elapsed / window_steps
            metrics["tokens_per_s"] = tokens_per_step * window_steps / elapsed
            metrics["mfu"] = mfu(cfg, metrics["tokens_per_s"], device)
            metrics.update(cuda_memory_gib(device))
            if eval_now:
                metrics["val_loss"] = evaluate(step_model, val_tokens, args, autocast, device)
            logger.log(step, metrics)
            bar.set_postfix_str(format_postfix(metrics))
            if bar.disable:  # not a terminal (a pipe, a log file): one plain line per log step instead
                print(f"step {step}/{args.steps}: {format_postfix(metrics)}", flush=True)
            summary = metrics
            if ckpt_now:
                save_checkpoint(ckpt_path, model, optimizer, scaler, step, cfg, args)
                last_good_ckpt = step
            if stop.requested:
                print(f"stopped at step {step}; resume with --resume --out {out}", file=sys.stderr)
                exit_code = 130
                break
            window_start, window_steps = time.perf_counter(), 0
        else:
            exit_code = 0
    finally:
        bar.close()
        stop.restore()
        logger.summary({f"final_{k}": v for k, v in summary.items()} | {"params": n_params, "steps": step})
        logger.close(exit_code)
    return {"step": step, "exit_code": exit_code, "model_config": cfg, **summary}


def format_postfix(m: dict) -> str:
    parts = [f"loss {m['loss']:.3f}", f"lr {m['lr']:.1e}", f"{m['step_ms']:.0f} ms", f"{m['tokens_per_s']:,.0f} tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "mem_peak_gib" in m:
        parts.append(f"peak {m['mem_peak_gib']:.1f} GiB")
    if "val_loss" in m:
        parts.append(f"val {m['val_loss']:.3f}")
    return ", ".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        result = train(args)
    except (TrainingError, FileNotFoundError, ValueError, UnknownBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        device = torch.device(args.device)
        total = torch.cuda.get_device_properties(device).total_memory / 1024**3
        figures = ", ".join(f"{k} {v:.2f}" for k, v in cuda_memory_gib(device).items())
        print(f"error: CUDA out of memory on {torch.cuda.get_device_name(device)} ({total:.1f} GiB): {figures}\n"
              f"config: --size {args.size} --batch-size {args.batch_size} --context-length {args.context_length} "
              f"--dtype {args.dtype} --attn {args.attn}{' --compile' if args.compile else ''}\n"
              "try a smaller --batch-size or --context-length, --dtype bf16, or --attn flash", file=sys.stderr)
        return 1
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
