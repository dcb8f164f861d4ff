"""Train a from-scratch Transformer LM: `python train.py --attn flash --dtype bf16`.

Logs loss, learning rate, gradient norm, step time, tokens/s, MFU and memory to the console (a progress bar),
to `<out>/metrics.jsonl` and to Weights & Biases; checkpoints atomically to `<out>/checkpoint.pt`.
On several GPUs: `torchrun --nproc-per-node N train.py --parallel {ddp,fsdp} ...` (see training/distributed.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from attention import UnknownBackendError, backend_names
from model import PRESETS, ModelConfig, TransformerLM, config_for
from training import checkpoint, distributed, sharded_checkpoint
from training.activation_checkpointing import checkpoint_blocks
from training.compilation import COMPILE_SCOPES, compile_regions
from training.cuda_graph import GraphedStep
from training.data import batch_at, check_vocab, load_corpus, split_train_val
from training.distributed import DistContext, DistributedError
from training.logger import METRICS_FILE, MetricsLogger, NullLogger
from training.metrics import cuda_memory_gib, flops_per_token, mfu
from training.overlapped_optimizer import OverlappedOptimizer, step_partitions
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
    m.add_argument("--weight-grads", choices=["fp32", "autocast"], default="fp32",
                   help="under bf16/fp16 autocast, Linear weight gradients written in fp32 by their matmul (default) "
                        "or as plain autocast does (low dtype, then cast)")
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
    o.add_argument("--compile", action="store_true", help="torch.compile the model (see --compile-scope)")
    o.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="blocks",
                   help="with --compile: blocks compiles each block (one graph, reused by every block: compile time "
                        "does not grow with depth) and the LM head with the loss; model compiles the whole model as "
                        "one graph")
    o.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole step (forward, backward, clipping, AdamW) once as a CUDA graph and replay "
                        "it: no host time per step. One CUDA device, bf16 or fp32; the first 2 steps run eagerly")
    o.add_argument("--overlap-optimizer", action="store_true",
                   help="step AdamW parameter by parameter during the backward, on a second CUDA stream, as each "
                        "gradient is complete (training/overlapped_optimizer.py): the same updates, a shorter step. "
                        "Needs --grad-clip 0 (no global norm before the steps), one process, bf16 or fp32")
    o.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward instead of storing its activations (less memory, "
                        "about one more forward of compute)")
    d = p.add_argument_group("multi-GPU (launch with torchrun)")
    d.add_argument("--parallel", choices=distributed.PARALLEL_MODES, default="none",
                   help="none: one process; ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard per block. "
                        "--batch-size is the global batch, split evenly over the ranks")
    d.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before the run fails")
    r = p.add_argument_group("run")
    r.add_argument("--data", help="token file (.bin uint16 / .npy), text file, directory of text files, or "
                                  "'synthetic'; default: this Python's standard library sources as bytes")
    r.add_argument("--eval-every", type=int, default=200, help="validation loss every N steps (0: only at the end)")
    r.add_argument("--eval-batches", type=int, default=10, help="validation batches per evaluation")
    r.add_argument("--log-every", type=int, default=10, help="log metrics every N steps")
    r.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps (0: only at the end)")
    r.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint at all (throughput runs)")
    r.add_argument("--out", default="runs/train", help="output directory (metrics, checkpoint, W&B run)")
    r.add_argument("--resume", action="store_true",
                   help=f"continue from <out>/{checkpoint.CHECKPOINT_NAME} (<out>/{sharded_checkpoint.DCP_DIR_NAME} "
                        "with --parallel fsdp)")
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
    if args.parallel == "fsdp" and args.dtype == "fp16":
        p.error("--parallel fsdp supports --dtype bf16 or fp32 (fp16 would need a sharded gradient scaler)")
    if args.dtype == "fp16" and not args.device.startswith("cuda"):
        p.error("--dtype fp16 needs a CUDA device (the gradient scaler is CUDA-only); use bf16 or fp32 on the CPU")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} asked for, but no CUDA GPU is visible; use --device cpu"
                f"{' (the ranks then talk over gloo)' if args.parallel != 'none' else ''}")
    if args.dist_timeout <= 0:
        p.error(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.overlap_optimizer:
        if args.grad_clip > 0:
            p.error("--overlap-optimizer steps each parameter as soon as its gradient exists, before the global "
                    "norm is known: add --grad-clip 0")
        if args.parallel != "none":
            p.error("--overlap-optimizer is for one process (DDP and FSDP reduce gradients after its hooks); "
                    "drop --parallel")
        if args.dtype == "fp16":
            p.error("--overlap-optimizer supports --dtype bf16 or fp32 (fp16's loss scale is checked for inf "
                    "after the whole backward)")
    if args.cuda_graph:
        if not args.device.startswith("cuda"):
            p.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
        if args.parallel != "none":
            p.error("--cuda-graph is for one process; drop --parallel")
        if args.dtype == "fp16":
            p.error("--cuda-graph supports --dtype bf16 or fp32 (fp16's gradient scaler checks for inf on the host)")


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    try:
        return config_for(args.size, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          d_ff=args.d_ff, vocab_size=vocab_size, context_length=args.context_length, attn=args.attn,
                          fp32_weight_grads=args.weight_grads == "fp32")
    except ValueError as e:
        raise TrainingError(str(e)) from None


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace,
                   device: torch.device) -> torch.optim.AdamW | OverlappedOptimizer:
    # A CUDA graph replays the step as captured: the step count must live on the GPU (capturable) and the learning
    # rate be a tensor that set_lr updates in place.
    lr = torch.tensor(args.lr, device=device) if args.cuda_graph else args.lr

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        # Decay matrices only: norm gains are scales, decaying them towards 0 fights the normalisation.
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                 fused=device.type == "cuda", capturable=args.cuda_graph)

    if args.overlap_optimizer:
        return OverlappedOptimizer(step_partitions(model), adamw, track_grad_norm=True)
    return adamw(list(model.parameters()))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate; a tensor learning rate (CUDA graphs) is written in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: contextlib.AbstractContextManager):
    """Mean next-token cross-entropy, in fp32, computed inside the model: in its compiled code under --compile."""
    with autocast:
        return model(x, y)


@torch.no_grad()
def evaluate(model, val_tokens, args, autocast, ctx: DistContext) -> float:
    """Mean validation loss over --eval-batches global batches (each rank scores its slice)."""
    model.eval()
    # Fixed batches (seeded by index, not by training step) so every evaluation sees the same data.
    losses = [lm_loss(model, *batch_at(val_tokens, args.batch_size, args.context_length, args.seed, i,
                                       rank=ctx.rank, world_size=ctx.world_size, device=ctx.device), autocast)
              for i in range(args.eval_batches)]
    model.train()
    return distributed.mean_over_ranks(torch.stack(losses).mean(), ctx)


class StopRequest:
    """First Ctrl-C asks the loop to checkpoint and stop at the next step boundary; a second one aborts.

    Under torchrun, Ctrl-C reaches torchrun, which forwards one SIGINT to every rank and kills them after a grace
    period (30 s by default); the ranks agree on the stop step, so all checkpoint the same one.
    """

    def __init__(self, announce: bool = True):
        self.requested = False
        self._announce = announce
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self._announce:
            print("\nCtrl-C: saving a checkpoint at the end of this step (press again to abort)", file=sys.stderr)

    def restore(self):
        signal.signal(signal.SIGINT, self._previous)


def checkpoint_path(out: Path, ctx: DistContext) -> Path:
    """FSDP runs checkpoint to a sharded directory; one process and DDP to the single file."""
    return out / (sharded_checkpoint.DCP_DIR_NAME if ctx.parallel == "fsdp" else checkpoint.CHECKPOINT_NAME)


def save_checkpoint(path: Path, model, optimizer, scaler, step: int, cfg: ModelConfig, args,
                    ctx: DistContext = DistContext()) -> None:
    """Called on every rank. DDP's ranks hold identical weights, so rank 0 writes the one-process file."""
    extras = {
        "scaler": scaler.state_dict(),
        "step": step,  # also the data position: batches are drawn by (seed, step)
        "rng": checkpoint.rng_state(),
        "model_config": cfg.to_dict(),
        "args": vars(args),
    }
    if ctx.parallel == "fsdp":
        sharded_checkpoint.save(path, model, optimizer, extras, ctx)
        return
    if ctx.is_main:
        checkpoint.save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extras}, path)
    distributed.barrier(ctx)


def load_checkpoint(path: Path, model, optimizer, scaler, cfg: ModelConfig, ctx: DistContext) -> int:
    """Restore model, optimizer, scaler and RNG from the checkpoint at `path`; returns the step to continue from."""
    sharded = ctx.parallel == "fsdp"
    if not (sharded_checkpoint.exists(path) if sharded else path.exists()):
        other = path.with_name(checkpoint.CHECKPOINT_NAME if sharded else sharded_checkpoint.DCP_DIR_NAME)
        if sharded and other.exists():
            raise TrainingError(f"no sharded checkpoint at {path}, but {other} exists: a single-file checkpoint "
                                "resumes with --parallel ddp or none, not fsdp")
        if other.exists():
            raise TrainingError(f"no {path.name} at {path.parent}, but the sharded FSDP checkpoint {other} exists: "
                                f"resume with --parallel fsdp, or consolidate it first with "
                                f"`python -m training.consolidate {other} {path}`")
    state = sharded_checkpoint.load_extras(path) if sharded else checkpoint.load(path)
    asked = cfg.to_dict()
    # A checkpoint from before a field existed lacks it; fp32_weight_grads changes how dW is computed, not the model.
    saved = {**asked, **state["model_config"], "fp32_weight_grads": cfg.fp32_weight_grads}
    if saved != asked:
        diff = {k: (v, asked.get(k)) for k, v in saved.items() if asked.get(k) != v}
        raise TrainingError(f"checkpoint {path} was written for another model: (saved, asked) {diff}")
    if sharded:
        sharded_checkpoint.load(path, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    checkpoint.set_rng_state(state["rng"])
    return state["step"]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint we resume from, so metrics.jsonl reads as one run."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(r + "\n" for r in rows))


def _quiet(*args, **kwargs) -> None:
    """print() of ranks other than 0."""


def train(args: argparse.Namespace, ctx: Optional[DistContext] = None) -> dict:
    ctx = ctx or DistContext(device=torch.device(args.device))
    device = ctx.device
    say = print if ctx.is_main else _quiet
    out = Path(args.out)
    torch.manual_seed(args.seed)

    with distributed.main_first(ctx):  # rank 0 builds the token cache, the other ranks then read it
        corpus = load_corpus(args.data, cache_dir=out.parent / ".token_cache", seed=args.seed,
                             synthetic_vocab=args.vocab_size or 10_000)
    vocab_size = args.vocab_size or corpus.vocab_size or 10_000
    check_vocab(corpus.tokens, vocab_size)
    train_tokens, val_tokens = split_train_val(corpus.tokens, args.context_length)
    cfg = model_config(args, vocab_size)

    with device:  # initialised on the device itself: quick for large models, and the same on every rank
        model = TransformerLM(cfg)
    if args.activation_checkpointing:
        checkpoint_blocks(model)
    if args.compile and args.compile_scope == "blocks":
        compile_regions(model)  # after checkpointing (the recomputed forward is compiled), before FSDP: as torchtitan
    step_model = distributed.wrap_model(model, ctx, DTYPES[args.dtype])  # `model` keeps the plain names
    optimizer = make_optimizer(model, args, device)  # after wrapping: FSDP replaces the parameters by shards
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    ckpt_path = checkpoint_path(out, ctx)
    start_step = 0
    if args.resume:
        start_step = load_checkpoint(ckpt_path, model, optimizer, scaler, cfg, ctx)
        for group in optimizer.param_groups:  # the checkpoint's run may have had the other kind of learning rate
            lr = float(group["lr"])
            group["lr"] = torch.tensor(lr, device=device) if args.cuda_graph else lr
        if ctx.is_main:
            truncate_metrics(out / METRICS_FILE, start_step)
    if args.compile and args.compile_scope == "model":
        step_model = torch.compile(step_model)
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32")
    max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping and AdamW; (loss, grad norm). The scaler is a no-op unless fp16, which
        --cuda-graph refuses: its inf checks read values on the host, which a captured step cannot. With
        --overlap-optimizer, AdamW runs inside the backward and there is no clipping."""
        loss = lm_loss(step_model, x, y, autocast)
        if isinstance(optimizer, OverlappedOptimizer):  # it stepped during the backward; step() waits for it
            loss.backward()
            optimizer.step()
            return loss.detach(), optimizer.grad_norm()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach(), grad_norm

    graphed = GraphedStep(train_step, optimizer, warmup=2) if args.cuda_graph else None

    n_params, n_non_embed = model.num_params(), model.num_params(non_embedding=True)
    tokens_per_step = args.batch_size * args.context_length  # global: all ranks together
    ranks = f", {args.parallel} over {ctx.world_size} rank{'s' * (ctx.world_size > 1)}" if ctx.is_distributed else ""
    say(f"model: {n_params / 1e6:.1f}M parameters ({n_non_embed / 1e6:.1f}M non-embedding), "
        f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, attention {cfg.attn!r}, "
        f"{args.dtype} on {device}{ranks}")
    say(f"data: {corpus.description}: {len(train_tokens):,} train / {len(val_tokens):,} val tokens, "
        f"vocab {vocab_size}; {flops_per_token(cfg) / 1e9:.2f} GFLOP per token")

    logger = MetricsLogger(out, args.wandb, args.wandb_project, {**vars(args), "model": cfg.to_dict(),
                           "params": n_params, "params_non_embedding": n_non_embed, "world_size": ctx.world_size},
                           append=args.resume) if ctx.is_main else NullLogger()
    stop = StopRequest(announce=ctx.is_main)
    step, summary, exit_code = start_step, {}, 1
    window_start, window_steps = time.perf_counter(), 0
    last_good_ckpt: Optional[int] = start_step if args.resume else None
    bar = tqdm(total=args.steps, initial=start_step, desc="train", dynamic_ncols=True,
               disable=None if ctx.is_main else True)
    try:
        while step < args.steps:
            lr = lr_at(step, args.lr, args.min_lr, args.warmup_steps, args.steps)
            set_lr(optimizer, lr)
            x, y = batch_at(train_tokens, args.batch_size, args.context_length, args.seed, step,
                            rank=ctx.rank, world_size=ctx.world_size, device=device)
            if graphed is not None:
                loss, grad_norm = graphed(x, y)  # sets the gradients to None itself before each eager step
            else:
                loss, grad_norm = train_step(x, y)
                optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            bar.update(1)

            stop_now = distributed.any_rank(stop.requested, ctx)  # every rank stops (and saves) at the same step
            is_last = step == args.steps
            eval_now = is_last or (args.eval_every > 0 and step % args.eval_every == 0)
            log_now = step % args.log_every == 0 or eval_now or stop_now
            ckpt_now = not args.no_checkpoint and (
                is_last or stop_now or (args.ckpt_every > 0 and step % args.ckpt_every == 0))
            if not (log_now or ckpt_now):
                continue
            loss_value = distributed.mean_over_ranks(loss, ctx)  # synchronises; only on log/checkpoint steps
            if not math.isfinite(loss_value):  # the global mean: NaN on any rank stops them all
                where = f"{ckpt_path} (step {last_good_ckpt})" if last_good_ckpt is not None else "none was written"
                raise TrainingError(f"loss became {loss_value} at step {step}; stopping. Last good checkpoint: {where}")
            metrics = {"loss": loss_value, "lr": lr, "grad_norm": distributed.full_value(grad_norm).item()}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - window_start
            metrics["step_ms"] = 1000 * elapsed / window_steps
            metrics["tokens_per_s"] = tokens_per_step * window_steps / elapsed
            metrics["mfu"] = mfu(cfg, metrics["tokens_per_s"], device, n_devices=ctx.world_size)
            metrics.update(distributed.max_over_ranks(cuda_memory_gib(device), ctx))  # the fullest rank
            if eval_now:
                metrics["val_loss"] = evaluate(step_model, val_tokens, args, autocast, ctx)
            logger.log(step, metrics)
            bar.set_postfix_str(format_postfix(metrics))
            if bar.disable:  # not a terminal (a pipe, a log file): one plain line per log step instead
                say(f"step {step}/{args.steps}: {format_postfix(metrics)}", flush=True)
            summary = metrics
            if ckpt_now:
                save_checkpoint(ckpt_path, model, optimizer, scaler, step, cfg, args, ctx)
                last_good_ckpt = step
            if stop_now:
                say(f"stopped at step {step}; " + ("--no-checkpoint: nothing saved" if args.no_checkpoint else
                                                   f"resume with --resume --out {out}"), file=sys.stderr)
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
    who = distributed.error_prefix(args.parallel)  # '[rank r] ' when several processes print
    try:
        with distributed.session(args.parallel, args.device, args.batch_size, args.dist_timeout) as ctx:
            result = train(args, ctx)
    except (TrainingError, DistributedError, FileNotFoundError, ValueError, UnknownBackendError) as e:
        print(f"{who}error: {e}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError:
        device = distributed.local_device(args.device, args.parallel)
        total = torch.cuda.get_device_properties(device).total_memory / 1024**3
        figures = ", ".join(f"{k} {v:.2f}" for k, v in cuda_memory_gib(device).items())
        print(f"{who}error: CUDA out of memory on {torch.cuda.get_device_name(device)} ({total:.1f} GiB): {figures}\n"
              f"config: --size {args.size} --batch-size {args.batch_size} --context-length {args.context_length} "
              f"--dtype {args.dtype} --attn {args.attn}"
              f"{' --compile --compile-scope ' + args.compile_scope if args.compile else ''}"
              f"{' --parallel ' + args.parallel if args.parallel != 'none' else ''}\n"
              "try a smaller --batch-size or --context-length, --dtype bf16, --attn flash, "
              "--activation-checkpointing, or --parallel fsdp over more GPUs", file=sys.stderr)
        return 1
    except (torch.distributed.DistError, RuntimeError) as e:
        if args.parallel == "none":
            raise
        # A collective that timed out inside DDP's backward arrives as a plain RuntimeError from gloo.
        if isinstance(e, torch.distributed.DistError) or "Timed out" in str(e):
            print(f"{who}error: a collective failed; another rank probably died, or stalled longer than "
                  f"--dist-timeout ({args.dist_timeout:g} s). Its own error is in its output (torchrun names the "
                  f"failed rank).\n{type(e).__name__}: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        # Returning would release this rank's DDP/FSDP state, which waits on its peers: forever behind a stalled one.
        distributed.exit_now(1)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
