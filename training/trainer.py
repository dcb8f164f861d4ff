"""The training loop: `Trainer(config, ctx).fit()`.

The Trainer owns the loop and calls the pieces that know the rest: the data source and its batches
(training/data), the step (training/step.py), evaluation, the metrics logger, checkpoints (training/checkpoint) and
the run directory (training/run). Everything is checked before the output directory is changed: the flags by
training.config.resolve, the data when it is opened, the directory when its lock is taken.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from model import TransformerLM
from profiling.run_profiler import RunProfiler, profile_window
from training.checkpoint.resume import load_checkpoint, save_checkpoint
from training.cli import write_config
from training.config import Config
from training.data import open_source, vocab_of
from training.data.record import check_resume_data, record_data
from training.data.sampling import Sampler
from training.evaluation import Evaluation, evaluate
from training.init_from import Initialisation
from training.logger import MetricsLogger, NullLogger
from training.metrics import cuda_memory_gib, flops_per_token, mfu
from training.metrics_file import METRICS_FILE, MetricsError, cut_after
from training.optim.schedule import lr_at
from training.parallel import distributed
from training.parallel.distributed import DistContext
from training.parallel.wrap import free_gathered_weights
from training.precision import use_deterministic_algorithms
from training.progress import Progress, duration
from training.run import directory
from training.run.failures import RunError, StoppedAtOnce
from training.run.signals import Interrupted, StopRequest, stop_status
from training.step import build_step, warm_up_steps

CPU_HOUR_WARNING_S = 3600.0
CPU_SIZED = "--size tiny --context-length 128 --batch-size 8 --steps 200"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(*args: Any, **kwargs: Any) -> None:
    """print() of ranks other than 0."""


@dataclass
class RunState:
    """Where the loop stands: the step done, the newest checkpoint whose weights were finite, the last figures."""

    step: int = 0
    checkpoint: Optional[Path] = None
    checkpoint_step: Optional[int] = None
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: int = 1
    seconds: float = 0.0


class Trainer:
    """One run of `config` (resolved: training.config.resolve) in the process group `ctx`."""

    def __init__(self, config: Config, ctx: Optional[DistContext] = None):
        self.ctx = ctx or DistContext(device=torch.device(config.execution.device))
        self.say = print if self.ctx.is_main else _quiet
        self.warn = _stderr if self.ctx.is_main else _quiet
        self.out = Path(config.run.out)
        use_deterministic_algorithms(config.execution.deterministic)
        torch.manual_seed(config.run.seed)
        with distributed.main_first(self.ctx):  # rank 0 builds the token cache, the other ranks then read it
            self.source = open_source(config.data.data, config.model.context_length, self.out.parent / ".token_cache",
                                      config.data.vocab_size, config.run.seed)
        self.init = Initialisation.of(config)  # --init-from: weights (and tokenizer) of a Hugging Face directory
        if self.init:
            self.init.check_data(self.source, config.data.data)
        # A model from a Hugging Face directory (now, or resumed) keeps its vocabulary, which may exceed the data's.
        vocab = vocab_of(self.source, config.model.vocab_size if config.run.init_from else config.data.vocab_size)
        self.config = config = config.replace(model={"vocab_size": vocab})
        self.data_change = (check_resume_data(self.out, self.source, config.data.data_changed)
                            if config.run.resume else None)
        self.sampler = Sampler(self.source, config.data.batch_size, config.model.context_length, config.run.seed,
                               self.ctx.rank, self.ctx.world_size, self.ctx.device, config.data.pack_documents)
        self.token_bytes = (None if self.source.token_bytes is None
                            else torch.as_tensor(self.source.token_bytes, device=self.ctx.device))
        with self.ctx.device:  # initialised on the device itself: quick for large models, the same on every rank
            self.model = TransformerLM(config.model, config.execution.attn)
        if self.init:  # before the step wraps, shards or compiles the model
            self.init.load_into(self.model)
        self.step_fn = build_step(self.model, config, self.ctx)
        self.state = RunState()
        self.logger: MetricsLogger | NullLogger = NullLogger()  # fit() opens the run's own (none if nothing to do)
        self.to_do = self._resume() if config.run.resume else True
        if self.ctx.is_main:  # every input checked and the checkpoint loaded: now the directory changes
            directory.prepare(self.out, config.run.overwrite, self.warn)
            record_data(self.source, self.out, self.data_change, self.init.directory if self.init else None)
            write_config(config, self.out)

    # ------------------------------------------------------------------------------------------------ set-up

    def _resume(self) -> bool:
        """Load the newest good checkpoint; False when there is nothing left to do."""
        start = time.perf_counter()
        resumed = load_checkpoint(self.out, self.model, self.step_fn.optimizer, self.step_fn.scaler, self.config,
                                  self.ctx, self.warn)
        seconds = time.perf_counter() - start
        self.state.step, self.state.checkpoint = resumed.step, resumed.path
        self.state.checkpoint_step = resumed.step
        self.say(f"resuming from {resumed.path} (step {resumed.step}), loaded in {seconds:.1f} s")
        for line in resumed.changes:
            self.say(line)
        steps = self.config.run.steps
        if resumed.step > steps:
            raise RunError(f"--steps {steps} is below the step of {resumed.path} ({resumed.step}); pass --steps "
                           f"{resumed.step} or more")
        if resumed.step == steps:
            self.say(f"nothing to do: {resumed.path} is at step {steps}, which is --steps {steps}; pass a larger "
                     "--steps to train on")
            return False
        return True

    def describe(self) -> str:
        """What will run, in words: the first lines a run prints."""
        c, m = self.config, self.config.model
        params = self.model.num_params()
        variants = ([f"{m.kv_heads} kv heads"] if m.kv_heads != m.n_heads else []) + (
            [f"window {m.window} ({m.window_pattern})"] if m.window else []) + (
            [f"softcap {m.attn_softcap:g}"] if m.attn_softcap else []) + (["QK-norm"] if m.qk_norm else []) + (
            [f"{m.mlp} MLP"] if m.mlp != "swiglu" else []) + (["zero-initialised residual projections"]
                                                               if m.zero_init_residual else []) + (
            [f"logit softcap {m.logit_softcap:g}"] if m.logit_softcap else [])
        ranks = f", {c.execution.parallel} over {self.ctx.world_size} ranks" if self.ctx.is_distributed else ""
        return (f"model: {params / 1e6:.1f}M parameters, d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads"
                f"{''.join(', ' + v for v in variants)}, context {m.context_length}, vocabulary {m.vocab_size}; "
                f"attention {c.execution.attn} on {self.ctx.device}{ranks}\n"
                f"data: {self.source.description}: {len(self.source.train):,} train / {len(self.source.val):,} val "
                f"tokens; batches of {c.data.batch_size} x {m.context_length} tokens"
                f"{', packed by documents' if c.data.pack_documents else ''}; "
                f"{flops_per_token(m) / 1e9:.2f} GFLOP per token\n"
                f"steps {self.state.step} to {c.run.steps}, {c.optim.optimizer} lr {c.optim.lr:g} (warm-up "
                f"{c.optim.warmup_steps}, cosine to {c.optim.min_lr:g})"
                + (f"\n{self.init.describe()}" if self.init else ""))

    # ------------------------------------------------------------------------------------------------ the loop

    def fit(self) -> RunState:
        """Train to config.run.steps; returns where the run ended (exit_code 0: done; 128 + n: stopped by signal n)."""
        if not self.to_do:
            self.state.exit_code = 0
            return self.state
        if self.config.run.resume and self.ctx.is_main:  # rows logged after the checkpoint, by the stopped run, go
            cut_after(self.out / METRICS_FILE, self.state.step, self.warn)
        self.say(self.describe())
        self.logger = (MetricsLogger(self.out, self.config.run.wandb, self.config.run.wandb_project,
                                     self.config.to_dict(), append=self.config.run.resume)
                       if self.ctx.is_main else NullLogger())
        stop = StopRequest(announce=self.ctx.is_main)
        progress = Progress(self.config.run.steps, "train", initial=self.state.step, file=sys.stdout,
                            enabled=self.ctx.is_main)
        start = time.perf_counter()
        try:
            self._loop(stop, progress)
        except Interrupted:
            last = f"the last checkpoint is {self.state.checkpoint}" if self.state.checkpoint else "none was written"
            raise StoppedAtOnce(f"second Ctrl-C: stopped at once, without a checkpoint of this step; {last}") from None
        finally:
            self.state.seconds = time.perf_counter() - start
            progress.close()
            stop.restore()
            self.logger.summary({f"final_{k}": v for k, v in self.state.metrics.items()} | {"steps": self.state.step})
            self.logger.close(self.state.exit_code)
        return self.state

    def _loop(self, stop: StopRequest, progress: Progress) -> None:
        run, state, first = self.config.run, self.state, self.state.step
        warm = min(warm_up_steps(self.config), run.steps - first)
        window = Window(time.perf_counter(), 0)
        if warm:
            progress.write(f"warming up: the first {warm} step{'s' * (warm > 1)} compile"
                           f"{' and capture the CUDA graph' if self.config.execution.cuda_graph else ''} (timed apart)")
        profiler = self._profiler(first, warm)
        try:
            self._steps(stop, progress, first, warm, window, profiler)
        finally:
            if profiler is not None:
                profiler.close()

    def _profiler(self, first: int, warm: int) -> Optional[RunProfiler]:
        """--profile's window of steps, or None."""
        run = self.config.run
        if run.profile is None:
            return None
        start, count = profile_window(first, warm, run.steps, run.profile_steps)
        if count == 0:
            self.warn(f"--profile: a run of {run.steps - first} step records none (one warms the profiler up)")
            return None
        return RunProfiler(Path(run.profile), start, count, self.ctx.device, self.ctx.rank, _stderr)

    def _steps(self, stop: StopRequest, progress: Progress, first: int, warm: int, window: "Window",
               profiler: Optional[RunProfiler]) -> None:
        run, state = self.config.run, self.state
        while state.step < run.steps:
            # Without a warm-up, the first step reports at once, so that a piped run says something.
            early = not warm and state.step == first
            if profiler is not None:
                profiler.before_step(state.step)
            loss, grad_norm, lr = self._train_step(state.step, early or self._due(state.step + 1))
            state.step += 1
            if profiler is not None and (line := profiler.after_step(state.step)) and self.ctx.is_main:
                progress.write(line)
            window.steps += 1
            progress.update(1)
            stop_now = distributed.any_rank(stop.requested, self.ctx)  # every rank stops at the same step
            due = early or self._due(state.step, stop_now)
            if warm and state.step == first + warm:
                self._end_warm_up(window, progress, warm, reset=not due)
            if not due:
                continue
            self._report(loss, grad_norm, lr, window, progress, stop_now)
            if stop_now:
                self.say(f"stopped at step {state.step}; {self._last_words()}", file=sys.stderr)
                signum = distributed.max_over_ranks({"signum": float(stop.signum or 0)}, self.ctx)["signum"]
                state.exit_code = stop_status(int(signum))
                return
            window.start, window.steps = time.perf_counter(), 0
        state.exit_code = 0

    def _train_step(self, step: int, report: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], float]:
        o = self.config.optim
        lr = lr_at(step, o.lr, o.min_lr, o.warmup_steps, self.config.run.steps)
        self.step_fn.set_lr(lr)
        batch = self.sampler.train(step)
        loss, grad_norm = self.step_fn(batch.inputs, batch.targets, batch.doc_ids, want_norm=report)
        return loss, grad_norm, lr

    def _end_warm_up(self, window: "Window", progress: Progress, warm: int, reset: bool) -> None:
        """Say how long the warm-up took; the next window times steps at speed (unless this step reports now: its
        window then keeps the warm-up steps rather than being empty)."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        progress.write(f"warm-up: {time.perf_counter() - window.start:.1f} s for {warm} step{'s' * (warm > 1)}; "
                       "logged step times start after it")
        if reset:
            window.start, window.steps = time.perf_counter(), 0
        progress.restart_clock()

    def _due(self, step: int, stop_now: bool = False) -> bool:
        """Whether the step that ends at `step` logs (or checkpoints): every --log-every steps, at evaluations and
        checkpoints, the last step and a stop."""
        run = self.config.run
        return (step % run.log_every == 0 or step == run.steps or stop_now or self._eval_due(step)
                or self._checkpoint_due(step, stop_now))

    def _eval_due(self, step: int) -> bool:
        run = self.config.run
        return step == run.steps or (run.eval_every > 0 and step % run.eval_every == 0)

    def _checkpoint_due(self, step: int, stop_now: bool) -> bool:
        run = self.config.run
        return run.keep_checkpoints > 0 and (step == run.steps or stop_now
                                             or (run.ckpt_every > 0 and step % run.ckpt_every == 0))

    def _report(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor], lr: float, window: "Window",
                progress: Progress, stop_now: bool) -> None:
        """Figures of the steps since the last report: log them, evaluate and checkpoint when due."""
        state = self.state
        loss_value = distributed.mean_over_ranks(loss, self.ctx)  # synchronises; only on log/checkpoint steps
        norm = None if grad_norm is None else distributed.full_value(grad_norm).item()
        if not (math.isfinite(loss_value) and (norm is None or math.isfinite(norm))):
            raise RunError(f"{'loss' if not math.isfinite(loss_value) else 'the gradient norm'} became "
                           f"{loss_value if not math.isfinite(loss_value) else norm} at step {state.step}; stopping. "
                           f"{self._last_good()}")
        metrics = {"loss": loss_value, "lr": lr, "grad_norm": norm, **self._speed(window)}
        if self.data_change is not None:  # the first row after a resume on other data says so
            metrics["data_changed"], self.data_change = self.data_change, None
        if self._eval_due(state.step):
            metrics.update(self.evaluate().metrics("val"))
        self._log(metrics)
        progress.report(format_postfix(metrics))
        state.metrics = metrics
        if self._checkpoint_due(state.step, stop_now):
            self.logger.sync()  # the rows up to this step are on disk before the checkpoint that covers them
            seconds = self._save()
            progress.write(f"checkpoint of step {state.step} written to {state.checkpoint} in {seconds:.1f} s")
        if self.ctx.device.type == "cpu":
            self._warn_if_long(progress)

    def _speed(self, window: "Window") -> dict[str, float]:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        elapsed = time.perf_counter() - window.start
        steps = max(window.steps, 1)
        tokens_per_s = self.config.data.batch_size * self.config.model.context_length * steps / elapsed
        figures = {"step_ms": 1000 * elapsed / steps, "tokens_per_s": tokens_per_s,
                   "mfu": mfu(self.config.model, tokens_per_s, self.ctx.device, n_devices=self.ctx.world_size)}
        return {**figures, **distributed.max_over_ranks(cuda_memory_gib(self.ctx.device), self.ctx)}

    def _warn_if_long(self, progress: Progress) -> None:
        left = progress.left()
        if left is not None and left > CPU_HOUR_WARNING_S and not getattr(self, "_warned_long", False):
            self._warned_long = True
            progress.write(f"note: at this speed the run takes about {duration(left)} more on the CPU; a CPU-sized "
                           f"run: {CPU_SIZED}")

    def evaluate(self) -> Evaluation:
        """Validation loss and bits per byte over --eval-batches fixed batches, in the step's micro-batches (what
        fits for training fits here); evaluate.py scores a checkpoint on the same batches."""
        model, n = self.step_fn.model, self.config.execution.grad_accum_steps
        model.eval()
        batches = (part for batch in self.sampler.val(self.config.run.eval_batches) for part in split(batch, n))
        result = evaluate(self.step_fn.loss, batches, self.token_bytes, self.ctx)
        if self.ctx.parallel == "fsdp":
            free_gathered_weights(model)
        model.train()
        return result

    def _log(self, metrics: dict[str, Any]) -> None:
        """A metrics row; a row that cannot be written (a full disk) stops the run after a checkpoint, if one fits."""
        error = None
        try:
            self.logger.log(self.state.step, metrics)
        except MetricsError as e:
            error = e
        if not distributed.any_rank(error is not None, self.ctx):
            return
        if self.config.run.keep_checkpoints == 0:
            raise RunError(f"{error}; --keep-checkpoints 0: nothing saved")
        try:
            self._save()
        except OSError as e:
            raise RunError(f"{error}; the checkpoint of step {self.state.step} could not be saved either "
                           f"({e.strerror}); {self._last_good()}") from None
        raise RunError(f"{error or 'rank 0 could not write metrics'}; saved a checkpoint at step {self.state.step} "
                       f"first: resume with --resume --out {self.out} once there is room")

    def _save(self) -> float:
        """A checkpoint of this step, if its weights are finite: a checkpoint on disk is always one to go back to.
        Returns the seconds the writing took, every rank's (the last barrier ends it on all of them)."""
        s = self.state
        bad = nonfinite_parameter(self.model)
        if distributed.any_rank(bad is not None, self.ctx):
            raise RunError(f"the weights became non-finite at step {s.step} ({bad or 'on another rank'}); stopping "
                           f"without a checkpoint of this step. {self._last_good()}")
        start = time.perf_counter()
        s.checkpoint = save_checkpoint(self.out, self.model, self.step_fn.optimizer, self.step_fn.scaler, s.step,
                                       self.config, self.ctx, self.config.run.keep_checkpoints)
        s.checkpoint_step = s.step
        return time.perf_counter() - start

    def _last_good(self) -> str:
        s = self.state
        return (f"Last good checkpoint: {s.checkpoint} (step {s.checkpoint_step})" if s.checkpoint
                else "Last good checkpoint: none was written")

    def _last_words(self) -> str:
        if self.config.run.keep_checkpoints == 0:
            return "--keep-checkpoints 0: nothing saved"
        return f"resume with --resume --out {self.out}"


def nonfinite_parameter(model: torch.nn.Module) -> Optional[str]:
    """The name of the first parameter (this rank's shard of it under FSDP) holding a NaN or an infinity, or None."""
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(local).all()):
            return name
    return None


@dataclass
class Window:
    """The steps since the last report and when they started: what step time and tokens/s are measured over."""

    start: float
    steps: int


def split(batch: Any, n: int) -> list[Any]:
    """A batch as n equal micro-batches (the step's gradient accumulation)."""
    from training.data.sampling import Batch

    if n == 1:
        return [batch]
    docs = batch.doc_ids.chunk(n) if batch.doc_ids is not None else [None] * n
    return [Batch(x, y, d) for x, y, d in zip(batch.inputs.chunk(n), batch.targets.chunk(n), docs)]


def format_postfix(m: dict[str, Any]) -> str:
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
