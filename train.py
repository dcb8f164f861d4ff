"""Train a from-scratch Transformer LM: `python train.py --attn flash --dtype bf16`.

Logs loss, learning rate, gradient norm, step time, tokens/s, MFU and memory to the console, to
`<out>/metrics.jsonl` and to Weights & Biases; keeps the newest checkpoints in <out>. Continue a run with
`--resume --steps N`. On several GPUs: `torchrun --nproc-per-node N train.py --parallel {ddp,fsdp} ...`.
Flags, outputs, and what happens on a kill, a signal or a full disk: docs/training.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from attention import UnknownBackendError
from model.config import preset_of
from training import cli
from training.checkpoint.files import CheckpointError
from training.checkpoint.resume import ResumeError
from training.config import ConfigError, Resolved, resolve
from training.data import DataError
from training.init_from import init_config
from training.metrics_file import MetricsError
from training.parallel import distributed
from training.parallel.distributed import DistributedError
from training.run.directory import RunDirError, owned
from training.run.failures import RunError, out_of_memory_message, run_main
from training.summary import summary_lines
from training.trainer import Trainer

EXPECTED = (RunError, ConfigError, DataError, DistributedError, RunDirError, CheckpointError, ResumeError,
            MetricsError, UnknownBackendError, FileNotFoundError)


def parse(argv: Optional[list[str]]) -> Resolved:
    """The resolved configuration of the command line; a bad flag exits 2 with one line."""
    try:
        config, explicit = cli.parse(argv, "train.py", __doc__)
        return resolve(init_config(config, explicit), explicit)  # --init-from: the model from its config.json
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def first_line(resolved: Resolved) -> str:
    """What will run, in words, before anything is read or built."""
    c, m = resolved.config, resolved.config.model
    size = preset_of(m)
    shape = f"{size} ({m.d_model} wide, {m.n_layers} layers)" if size else f"{m.d_model} wide, {m.n_layers} layers"
    return (f"training {shape} on {c.data.data or 'the built-in corpus'} for {c.run.steps} steps on "
            f"{c.execution.device}: {'; '.join(resolved.choices)}; writing {c.run.out}")


def train(resolved: Resolved) -> int:
    config, ex = resolved.config, resolved.config.execution
    with distributed.process_group(ex.parallel, ex.device, ex.dist_timeout) as ctx:
        if ctx.is_main:
            print(first_line(resolved))
            for line in resolved.warnings:
                print(line, file=sys.stderr)
        with owned(Path(config.run.out), config.run.resume, config.run.overwrite, ctx):
            trainer = Trainer(config, ctx)
            state = trainer.fit()
        if ctx.is_main:
            print("\n".join(summary_lines(trainer, state)))
        del trainer  # the DDP/FSDP model goes before its process group: freed after it, a rank could hang at exit
    return state.exit_code


def main(argv: Optional[list[str]] = None) -> int:
    try:
        resolved = parse(argv)
    except CheckpointError as e:  # --init-from's directory, which its model comes from, cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 1
    config = resolved.config
    prefix = distributed.error_prefix(config.execution.parallel)  # '[rank r] ' when several processes print
    what = (f"--batch-size {config.data.batch_size} --context-length {config.model.context_length} --d-model "
            f"{config.model.d_model} --n-layers {config.model.n_layers} --dtype {config.execution.dtype}")
    device = distributed.local_device(config.execution.device, config.execution.parallel)
    return run_main(lambda: train(resolved), EXPECTED, prefix, lambda e: out_of_memory_message(e, device, what),
                    distributed=config.execution.parallel != "none")


if __name__ == "__main__":
    sys.exit(main())
