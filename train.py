"""Train a from-scratch Transformer LM: `python train.py --attn flash --dtype bf16`.

Logs loss, learning rate, gradient norm, step time, tokens/s, MFU and memory to the console (a progress bar),
to `<out>/metrics.jsonl` and to Weights & Biases; keeps the last checkpoints as `<out>/checkpoint-<step>.pt`. The
step is built by training/step.py, the recipe bench_model.py times. Flags, outputs, and what happens on a kill, a
signal or a full disk: docs/training.md.
On several GPUs: `torchrun --nproc-per-node N train.py --parallel {ddp,fsdp} ...` (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from attention import UnknownBackendError, backend_names
from model import PRESETS, ModelConfig, TransformerLM, config_for
from training import checkpoint, cli, distributed, fp8, run_dir, sharded_checkpoint, speed_defaults
from training.checkpoint_files import CheckpointError
from training.data import batch_at, check_vocab
from training.dataset import check_vocab_size, load_run_data, record_tokenizer
from training.distributed import DistContext, DistributedError
from training.input_checks import backend_problem, flag_problem, flag_warnings
from training.evaluation import Evaluation, evaluate as evaluate_batches, sampled_batches
from training.logger import METRICS_FILE, MetricsLogger, NullLogger
from training.metrics import cuda_memory_gib, flops_per_token, mfu
from training.metrics_file import MetricsError, cut_after
from training.packing import packed_batch_at
from training.precision import DTYPES
from training.resume import load_checkpoint, save_checkpoint
from training.run_dir import RunDirError
from training.schedule import lr_at
from training.signals import Interrupted, StopRequest, stop_status
from training.step import GRAPH_WARMUP, OptimizerConfig, StepConfig, TrainingStep, build_step


class TrainingError(RuntimeError):
    """A run that must stop with a message (bad input, NaN loss); main() prints it and exits 1."""


class StoppedAtOnce(Exception):
    """A second Ctrl-C stopped the run without a checkpoint; main() prints the message and exits 130."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--size", default="small", help=f"size preset: {', '.join(PRESETS)}")
    cli.add_model_shape_flags(m, "override the preset's")
    m.add_argument("--vocab-size", type=int, help="vocabulary; default 256 for byte-level text, else 10000")
    m.add_argument("--context-length", type=int, default=1024, help="tokens per training sequence")
    m.add_argument("--attn", default="sdpa", help="attention backend from the registry (see README)")
    cli.add_attention_variant_flags(m)
    cli.add_weight_grads_flag(m)
    cli.add_residual_flag(m)
    cli.add_fused_rope_flag(m)
    cli.add_fused_gate_up_flag(m)
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    o.add_argument("--steps", type=int, default=1000, help="optimizer steps in total")
    o.add_argument("--grad-accum-steps", type=int, default=1,
                   help="split each step's batch into this many micro-batches, run one after another with their "
                        "gradients summed: the same update with the activation memory of one micro-batch (it must "
                        "divide the sequences per rank)")
    cli.add_optimizer_flags(o)  # --lr, --weight-decay, --grad-clip
    cli.add_optim_state_flag(o)
    o.add_argument("--min-lr", type=float, default=6e-5, help="learning rate at the end of the cosine decay")
    o.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps")
    o.add_argument("--dtype", choices=list(DTYPES),
                   help="compute precision: bf16/fp16 autocast with fp32 master weights (fp16 adds a grad scaler); "
                        "default bf16 on CUDA, fp32 on the CPU")
    o.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the model (see --compile-scope); default on with CUDA, off on the CPU")
    cli.add_compile_scope_flag(o)
    o.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
                   help="capture the whole step (forward, backward, clipping, AdamW) once as a CUDA graph and replay "
                        "it: no host time per step. One CUDA device, bf16 or fp32; the first 2 steps run eagerly. "
                        "Default on where it applies (CUDA, one process, no activation checkpointing, not fp16); "
                        "with --pack-documents each batch's document ids are an input of the graph")
    o.add_argument("--fp8", choices=list(fp8.RECIPES), default="off",
                   help="the blocks' Linear layers in float8 through torchao (training/fp8.py): tensorwise or rowwise "
                        "scaling; needs --dtype bf16 and a GPU with float8 matmuls (emulated on the CPU)")
    o.add_argument("--overlap-optimizer", action="store_true",
                   help="step AdamW parameter by parameter during the backward, on a second CUDA stream, as each "
                        "gradient is complete (training/overlapped_optimizer.py): the same updates, a shorter step. "
                        "Needs --grad-clip 0 (no global norm before the steps), one process, bf16 or fp32")
    o.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward instead of storing its activations (less memory, "
                        "about one more forward of compute)")
    d = p.add_argument_group("multi-GPU (launch with torchrun)")
    cli.add_parallel_flags(d, "none: one process; ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard per block. "
                              "--batch-size is the global batch, split evenly over the ranks",
                           600.0, "seconds a collective may wait for the other ranks before the run fails")
    r = p.add_argument_group("run")
    r.add_argument("--data", help="prepared directory (prepare_data.py: BPE or bytes, its vocabulary and tokenizer), "
                                  "token file (.bin uint16 / .npy), text file, directory of text files, or "
                                  "'synthetic'; default: this Python's standard library sources as bytes")
    r.add_argument("--pack-documents", action="store_true",
                   help="prepared data: each row starts where a document (or a context-length piece of a long one) "
                        "starts and runs on through the next ones, each led by its end-of-document token; attention "
                        "stays within each document and RoPE positions restart at each (the backend must run "
                        "doc_ids: naive, compiled, sdpa, flex, flash, flash-torch)")
    r.add_argument("--eval-every", type=int, default=200,
                   help="validation loss (and bits per byte) every N steps (0: only at the end)")
    r.add_argument("--eval-batches", type=int, default=10, help="validation batches per evaluation")
    r.add_argument("--log-every", type=int, default=10, help="log metrics every N steps")
    r.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps (0: only at the end)")
    r.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint at all (throughput runs)")
    r.add_argument("--out", default="runs/train", help="output directory (metrics, checkpoint, W&B run)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out that loads: <out>/checkpoint-<step>.pt "
                        f"(<out>/{checkpoint.CHECKPOINT_NAME} of earlier versions; <out>/"
                        f"{sharded_checkpoint.DCP_DIR_NAME} with --parallel fsdp)")
    r.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out that holds one: the earlier run is moved to <out>.old-<UTC time>")
    r.add_argument("--keep-checkpoints", type=int, default=2,
                   help="checkpoints kept in --out, the newest ones (one process and DDP; FSDP keeps one)")
    cli.add_device_flag(r)
    r.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    r.add_argument("--wandb", choices=["offline", "online", "disabled"], default="offline",
                   help="W&B mode; offline writes <out>/wandb for a later `wandb sync`")
    r.add_argument("--wandb-project", default="flash-lm", help="W&B project name")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Reject bad flags at once, naming the problem (argparse exits with status 2); fill in the defaults of --dtype,
    --compile and --cuda-graph (training/speed_defaults.py) and return the line that says what they are."""
    if args.size not in PRESETS:
        p.error(f"unknown --size {args.size!r}; valid: {', '.join(PRESETS)}")
    if args.attn not in backend_names():
        p.error(f"unknown --attn {args.attn!r}; valid: {', '.join(backend_names())}")
    cli.check_at_least(p, args, 1, "batch_size", "steps", "context_length", "eval_batches", "log_every",
                       "grad_accum_steps")
    if args.grad_accum_steps > 1 and args.overlap_optimizer:
        p.error("--overlap-optimizer steps AdamW during each backward, --grad-accum-steps needs all micro-batches' "
                "gradients first: drop one")
    if args.min_lr > args.lr:
        p.error(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    device = cli.check_device(p, args.device, args.parallel)
    cli.check_dist_timeout(p, args)
    speed = speed_defaults.choose(device, dtype=args.dtype, compile=args.compile, cuda_graph=args.cuda_graph,
                                  parallel=args.parallel, activation_checkpointing=args.activation_checkpointing)
    args.dtype, args.compile, args.cuda_graph = speed.dtype, speed.compile, speed.cuda_graph
    cli.check_step_flags(p, device, args.parallel, [args.dtype], args.cuda_graph, args.overlap_optimizer,
                         grad_clip=args.grad_clip, optim_state_dtypes=[args.optim_state_dtype])
    try:
        cfg = model_config(args, args.vocab_size or 256)
    except TrainingError as e:
        p.error(cli.config_error_as_flags(str(e)))
    problem = fp8.problem(args.fp8, device, args.dtype, args.parallel, cfg.d_model) or flag_problem(args)
    if problem:  # negative or contradictory
        p.error(problem)
    return speed.line


def variants_of(cfg: ModelConfig) -> str:
    """", 4 kv heads, window 256 (LLLG), softcap 50" for the attention variants in use, else ""."""
    parts = [f"{cfg.kv_heads} kv heads"] if cfg.kv_heads != cfg.n_heads else []
    if cfg.window is not None:
        parts.append(f"window {cfg.window} ({cfg.window_pattern})")
    if cfg.attn_softcap is not None:
        parts.append(f"softcap {cfg.attn_softcap:g}")
    return "".join(f", {p}" for p in parts)


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    try:
        return config_for(args.size, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          d_ff=args.d_ff, vocab_size=vocab_size, context_length=args.context_length, attn=args.attn,
                          fp32_weight_grads=args.weight_grads == "fp32", fused_rope=args.fused_rope == "on",
                          fp32_residual=args.residual == "fp32", fused_gate_up=args.fused_gate_up == "on",
                          n_kv_heads=args.n_kv_heads, window=args.window,
                          window_pattern=args.window_pattern, attn_softcap=args.attn_softcap)
    except ValueError as e:
        raise TrainingError(str(e)) from None


def step_config(args: argparse.Namespace) -> StepConfig:
    """The training step the flags ask for (training.step builds it, as for bench_model.py)."""
    return StepConfig(precision=args.dtype, compile=args.compile, compile_scope=args.compile_scope,
                      activation_checkpointing=args.activation_checkpointing,
                      overlap_optimizer=args.overlap_optimizer, cuda_graph=args.cuda_graph, fp8=args.fp8,
                      grad_accum_steps=args.grad_accum_steps, optim_state_dtype=args.optim_state_dtype,
                      optimizer=OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip))


def evaluate(step: TrainingStep, val_tokens, token_bytes: Optional[torch.Tensor], args,
             ctx: DistContext) -> Evaluation:
    """Validation loss and bits per byte over --eval-batches fixed global batches (each rank scores its slice, in
    the step's micro-batches: what fits in memory for training fits here); evaluate.py scores a checkpoint on the
    same batches."""
    step.model.eval()
    n = args.grad_accum_steps
    batches = ((xi, yi) for x, y in sampled_batches(val_tokens, args.batch_size, args.context_length,
                                                    args.eval_batches, args.seed, ctx)
               for xi, yi in zip(x.chunk(n), y.chunk(n)))
    result = evaluate_batches(step.loss, batches, token_bytes, ctx)
    step.model.train()
    return result


def _quiet(*args, **kwargs) -> None:
    """print() of ranks other than 0."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_run(args: argparse.Namespace, ctx: DistContext) -> None:
    """What must hold before the data is read, the model built or --out touched: the attention backend runs the
    model's attention on this device, and the micro-batches divide each rank's share of the batch."""
    cfg = model_config(args, args.vocab_size or 256)
    problem = backend_problem(args.attn, ctx.device, DTYPES[args.dtype], cfg.d_head,
                              kv_groups=cfg.n_heads // cfg.kv_heads, window=cfg.window, softcap=cfg.attn_softcap,
                              documents=args.pack_documents)
    if problem:
        raise TrainingError(problem)
    if (args.batch_size // ctx.world_size) % args.grad_accum_steps:
        raise TrainingError(f"--grad-accum-steps {args.grad_accum_steps} must divide the sequences per rank and step "
                            f"(--batch-size {args.batch_size} over {ctx.world_size} rank"
                            f"{'s' * (ctx.world_size > 1)}: {args.batch_size // ctx.world_size})")


@contextlib.contextmanager
def owning(out: Path, args: argparse.Namespace, ctx: DistContext) -> Iterator[None]:
    """Rank 0 holds --out's lock for the whole run (training.run_dir); every rank stops if it cannot take it."""
    lock, error = None, None
    if ctx.is_main:
        try:
            lock = run_dir.claim(out, args.resume, args.overwrite)
        except RunDirError as e:
            error = e
    if distributed.any_rank(error is not None, ctx):
        raise error or RunDirError(f"rank 0 could not take {out}; its message says why")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def train(args: argparse.Namespace, ctx: Optional[DistContext] = None) -> dict:
    ctx = ctx or DistContext(device=torch.device(args.device))
    device = ctx.device
    say = print if ctx.is_main else _quiet
    warn = _stderr if ctx.is_main else _quiet
    out = Path(args.out)
    torch.manual_seed(args.seed)

    with distributed.main_first(ctx):  # rank 0 builds the token cache, the other ranks then read it
        data = load_run_data(args.data, cache_dir=out.parent / ".token_cache", context_length=args.context_length,
                             synthetic_vocab=args.vocab_size or 10_000, seed=args.seed)
    check_vocab_size(data, args.vocab_size, args.data)
    if args.pack_documents and data.eod_id is None:
        raise TrainingError(f"--pack-documents needs prepared data (prepare_data.py, then --data DIR); "
                            f"{data.description} has no document boundaries")
    vocab_size = args.vocab_size or data.vocab_size or 10_000
    train_tokens, val_tokens = data.train, data.val
    for tokens in (train_tokens, val_tokens):
        check_vocab(tokens, vocab_size, data.description)
    token_bytes = None if data.token_bytes is None else torch.as_tensor(data.token_bytes, device=device)
    if ctx.is_main:  # the inputs are good: move an earlier run aside (--overwrite), remove killed writes' files
        run_dir.prepare(out, args.overwrite, warn)
    if ctx.is_main:
        record_tokenizer(data, out)  # evaluation and sampling decode with the tokenizer the run trained with
    cfg = model_config(args, vocab_size)

    with device:  # initialised on the device itself: quick for large models, and the same on every rank
        model = TransformerLM(cfg)
    step_fn = build_step(model, step_config(args), ctx)
    optimizer, scaler = step_fn.optimizer, step_fn.scaler
    start_step, last_ckpt = 0, None
    if args.resume:
        resumed = load_checkpoint(out, model, optimizer, scaler, cfg, args, ctx, warn)
        step_fn.match_lr_kind()  # the checkpoint's run may have had the other kind of learning rate
        start_step, last_ckpt = resumed.step, resumed.path
        say(f"resuming from {resumed.path} (step {resumed.step})")
        for line in resumed.changes:
            say(line)
        if start_step > args.steps:
            raise TrainingError(f"--steps {args.steps} is below the step of {resumed.path} ({start_step}); pass "
                                f"--steps {start_step} or more")
        if start_step == args.steps:
            say(f"nothing to do: {resumed.path} is at step {start_step}, which is --steps {args.steps}; pass a "
                "larger --steps to train on")
            return {"step": start_step, "exit_code": 0, "model_config": cfg}
        if ctx.is_main:  # rows logged after the checkpoint, by the run that was stopped, go
            cut_after(out / METRICS_FILE, start_step, warn)

    n_params, n_non_embed = model.num_params(), model.num_params(non_embedding=True)
    tokens_per_step = args.batch_size * args.context_length  # global: all ranks together
    ranks = f", {args.parallel} over {ctx.world_size} rank{'s' * (ctx.world_size > 1)}" if ctx.is_distributed else ""
    say(f"model: {n_params / 1e6:.1f}M parameters ({n_non_embed / 1e6:.1f}M non-embedding), "
        f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads{variants_of(cfg)}, "
        f"attention {cfg.attn!r}, "
        f"{args.dtype}{f' with float8 matmuls ({args.fp8})' if args.fp8 != 'off' else ''} on {device}{ranks}")
    say(f"data: {data.description}: {len(train_tokens):,} train / {len(val_tokens):,} val tokens, "
        f"vocab {vocab_size}; {flops_per_token(cfg) / 1e9:.2f} GFLOP per token")

    logger = MetricsLogger(out, args.wandb, args.wandb_project, {**vars(args), "model": cfg.to_dict(),
                           "params": n_params, "params_non_embedding": n_non_embed, "world_size": ctx.world_size},
                           append=args.resume) if ctx.is_main else NullLogger()
    stop = StopRequest(announce=ctx.is_main)
    step, summary, exit_code = start_step, {}, 1
    window_start, window_steps = time.perf_counter(), 0
    last_good_ckpt: Optional[int] = start_step if args.resume else None
    last_words = ("--no-checkpoint: nothing saved" if args.no_checkpoint else f"resume with --resume --out {out}")
    bar = tqdm(total=args.steps, initial=start_step, desc="train", dynamic_ncols=True,
               disable=None if ctx.is_main else True)
    # Steps that compile, autotune or capture rather than train at speed; timed on their own, out of the first window.
    warm_steps = min(GRAPH_WARMUP + 1 if args.cuda_graph else int(args.compile), args.steps - start_step)
    if warm_steps:
        what = "compile the model and autotune kernels" if args.compile else "autotune kernels"
        graph = f", and step {start_step + GRAPH_WARMUP + 1} captures the CUDA graph" if args.cuda_graph else ""
        say(f"warming up: the first {warm_steps} step{'s' * (warm_steps > 1)} {what}{graph} (timed when done)",
            flush=True)
    try:
        while step < args.steps:
            lr = lr_at(step, args.lr, args.min_lr, args.warmup_steps, args.steps)
            step_fn.set_lr(lr)
            doc_ids = None  # packed: attention stays within each document, RoPE restarts at each one
            if args.pack_documents:
                x, y, doc_ids = packed_batch_at(train_tokens, data.doc_starts("train"), data.eod_id, args.batch_size,
                                                args.context_length, args.seed, step, ctx.rank, ctx.world_size,
                                                device)
            else:
                x, y = batch_at(train_tokens, args.batch_size, args.context_length, args.seed, step,
                                rank=ctx.rank, world_size=ctx.world_size, device=device)
            loss, grad_norm = step_fn(x, y) if doc_ids is None else step_fn(x, y, doc_ids)
            step += 1
            window_steps += 1
            bar.update(1)

            stop_now = distributed.any_rank(stop.requested, ctx)  # every rank stops (and saves) at the same step
            is_last = step == args.steps
            eval_now = is_last or (args.eval_every > 0 and step % args.eval_every == 0)
            log_now = step % args.log_every == 0 or eval_now or stop_now
            ckpt_now = not args.no_checkpoint and (
                is_last or stop_now or (args.ckpt_every > 0 and step % args.ckpt_every == 0))
            if warm_steps and step == start_step + warm_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if ctx.is_main:
                    bar.write(f"warm-up: {time.perf_counter() - window_start:.1f} s for {warm_steps} "
                              f"step{'s' * (warm_steps > 1)}; logged step times start after it")
                if not log_now:  # logged here, the window keeps these steps rather than being empty
                    window_start, window_steps = time.perf_counter(), 0
            if not (log_now or ckpt_now):
                continue
            loss_value = distributed.mean_over_ranks(loss, ctx)  # synchronises; only on log/checkpoint steps
            if not math.isfinite(loss_value):  # the global mean: NaN on any rank stops them all
                where = f"{last_ckpt} (step {last_good_ckpt})" if last_ckpt is not None else "none was written"
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
                metrics.update(evaluate(step_fn, val_tokens, token_bytes, args, ctx).metrics("val"))
            write_error = None
            try:
                logger.log(step, metrics)
            except MetricsError as e:  # a full disk, say: checkpoint if that still works, then stop
                write_error = e
            if distributed.any_rank(write_error is not None, ctx):
                if args.no_checkpoint:
                    raise TrainingError(f"{write_error}; --no-checkpoint: nothing saved")
                try:
                    last_ckpt = save_checkpoint(out, model, optimizer, scaler, step, cfg, args, ctx,
                                                args.keep_checkpoints)
                except OSError as e:
                    where = f"the last one is {last_ckpt}" if last_ckpt is not None else "none was written"
                    raise TrainingError(f"{write_error}; the checkpoint of step {step} could not be saved either "
                                        f"({e.strerror}); {where}") from None
                raise TrainingError(f"{write_error or 'rank 0 could not write metrics'}; saved a checkpoint at step "
                                    f"{step} first: resume with --resume --out {out} once there is room")
            bar.set_postfix_str(format_postfix(metrics))
            if bar.disable:  # not a terminal (a pipe, a log file): one plain line per log step instead
                say(f"step {step}/{args.steps}: {format_postfix(metrics)}", flush=True)
            summary = metrics
            if ckpt_now:
                logger.sync()  # the rows up to this step are on disk before the checkpoint that covers them
                last_ckpt = save_checkpoint(out, model, optimizer, scaler, step, cfg, args, ctx, args.keep_checkpoints)
                last_good_ckpt = step
            if stop_now:
                say(f"stopped at step {step}; {last_words}", file=sys.stderr)
                # 128 + the signal's number (training.signals), the same on every rank, also on those that did not
                # receive it themselves
                signum = distributed.max_over_ranks({"signum": float(stop.signum or 0)}, ctx)["signum"]
                exit_code = stop_status(int(signum))
                break
            window_start, window_steps = time.perf_counter(), 0
        else:
            exit_code = 0
    except Interrupted:
        last = f"the last checkpoint is {last_ckpt}" if last_ckpt is not None else "no checkpoint was written"
        raise StoppedAtOnce(f"second Ctrl-C: stopped at once, without a checkpoint of this step; {last}") from None
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
    if "val_bpb" in m:
        parts.append(f"{m['val_bpb']:.3f} bpb")
    return ", ".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k for k, v in vars(args).items() if v != parser.get_default(k)}
    speed_line = check_args(parser, args)
    if os.environ.get("RANK", "0") == "0":
        print(speed_line)
        for line in flag_warnings(args, given):
            print(line, file=sys.stderr)
    who = distributed.error_prefix(args.parallel)  # '[rank r] ' when several processes print
    try:
        with distributed.process_group(args.parallel, args.device, args.batch_size, args.dist_timeout) as ctx:
            check_run(args, ctx)
            with owning(Path(args.out), args, ctx):
                result = train(args, ctx)
    except StoppedAtOnce as e:
        print(f"{who}{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # Ctrl-C before training started
        print(f"{who}interrupted (Ctrl-C) before training started; nothing was saved", file=sys.stderr)
        return 130
    except (TrainingError, DistributedError, FileNotFoundError, ValueError, UnknownBackendError, RunDirError,
            CheckpointError, MetricsError) as e:
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
