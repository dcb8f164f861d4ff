"""Several processes through torch.distributed: the process group and the collectives the loop needs.

Launch with `torchrun --nproc-per-node N train.py --parallel {ddp,fsdp} ...`. torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; rank r drives GPU LOCAL_RANK over NCCL (or the CPU over gloo with
`--device cpu`). `--parallel none` (the default) is one process and touches none of this.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping, NoReturn, Optional

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """A multi-process run that cannot start (launch, backend, batch split); the message says what to change."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: its rank among world_size processes and the device it drives."""

    parallel: str = "none"
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    # A gloo group for small CPU-side agreements (stop flags, barriers): no GPU sync, no NCCL device binding.
    # None means the default group, which is already gloo on the CPU.
    control_group: Optional[dist.ProcessGroup] = None

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, logs and writes single-file checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.parallel != "none"


def launch_env(parallel: str, env: Mapping[str, str] = os.environ, script: str = "train.py") -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables; an error naming the launcher when they are missing."""
    missing = [k for k in TORCHRUN_ENV if k not in env]
    if missing:
        raise DistributedError(
            f"--parallel {parallel} needs the process variables torchrun sets ({', '.join(missing)} missing); "
            f"launch with `torchrun --nproc-per-node N {script} --parallel {parallel} ...`, or drop --parallel "
            "to train in one process")
    rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not 0 <= rank < world:
        raise DistributedError(f"RANK {rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
    return rank, world, local


def local_device(device_arg: str, parallel: str, env: Mapping[str, str] = os.environ) -> torch.device:
    """The device this process drives: --device, with the GPU index taken from LOCAL_RANK when distributed."""
    device = torch.device(device_arg)
    if parallel == "none" or device.type != "cuda" or "LOCAL_RANK" not in env:
        return device
    return torch.device("cuda", int(env["LOCAL_RANK"]))


def check_backend(device: torch.device) -> str:
    """nccl for CUDA devices, gloo for the CPU; an error saying what to install or pass instead."""
    if not dist.is_available():
        raise DistributedError("this PyTorch build has no torch.distributed; install an official PyTorch wheel")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu to run the "
                                   "ranks on the CPU over gloo, or install a CUDA build of PyTorch")
        if not dist.is_nccl_available():
            raise DistributedError("NCCL is not available in this PyTorch build; use --device cpu (gloo backend) "
                                   "or install a CUDA build of PyTorch, which ships NCCL")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK {device.index} has no GPU: only {torch.cuda.device_count()} visible; "
                                   "use --nproc-per-node <= the number of GPUs")
        return "nccl"
    if device.type == "cpu":
        if not dist.is_gloo_available():
            raise DistributedError("gloo is not available in this PyTorch build; it is needed for --device cpu")
        return "gloo"
    raise DistributedError(f"--parallel supports cuda (nccl) and cpu (gloo) devices, not {device.type!r}")


def init(parallel: str, device_arg: str, timeout_s: float, script: str = "train.py") -> DistContext:
    """Join the process group torchrun set up; one process with no group when parallel is 'none'.

    `script` is the program named in the launch error (train.py, bench_model.py).
    """
    if parallel == "none":
        return DistContext(device=torch.device(device_arg))
    rank, world, _ = launch_env(parallel, script=script)
    device = local_device(device_arg, parallel)
    backend = check_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    # Every collective (and NCCL's watchdog) gives up after `timeout`: a dead or stuck rank becomes an error.
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return DistContext(parallel, rank, world, device, control)


def shutdown(ctx: DistContext) -> None:
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(parallel: str, device_arg: str, timeout_s: float, script: str = "train.py") -> Iterator[DistContext]:
    """init() ... shutdown(), the latter also when training raises."""
    ctx = init(parallel, device_arg, timeout_s, script)
    try:
        yield ctx
    finally:
        shutdown(ctx)


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier(group=ctx.control_group)


@contextmanager
def main_first(ctx: DistContext) -> Iterator[None]:
    """Run the block on rank 0 first (to build a cache the others then read), then on the other ranks.

    Rank 0 releases the others even when the block raises: they then run it and fail the same way.
    """
    if ctx.world_size == 1:
        yield
        return
    if ctx.is_main:
        try:
            yield
        finally:
            barrier(ctx)
    else:
        barrier(ctx)
        yield


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank if it is true on any: decisions that change the collectives (stop now) must agree."""
    if ctx.world_size == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)  # CPU tensor on the gloo control group: no GPU sync
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.control_group)
    return bool(t.item())


def mean_over_ranks(value: torch.Tensor, ctx: DistContext) -> float:
    """The mean over ranks of a scalar tensor (e.g. each rank's loss on its equal share of the batch)."""
    value = value.detach().float().reshape(1)
    if ctx.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value /= ctx.world_size
    return value.item()


def max_over_ranks(values: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Each figure's maximum over ranks (peak memory: the rank closest to running out)."""
    if ctx.world_size == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded one (FSDP's grad norm is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def error_prefix(parallel: str, env: Mapping[str, str] = os.environ) -> str:
    """'[rank r] ' for messages printed by several processes at once, else ''."""
    return f"[rank {env['RANK']}] " if parallel != "none" and "RANK" in env else ""


def exit_now(code: int) -> NoReturn:
    """Leave the process at once, output flushed, without running destructors or atexit hooks.

    For a rank whose step failed mid-collective: its DDP/FSDP state holds work that waits on the other ranks,
    and releasing it would wait too (behind a stalled rank, forever). torchrun sees the exit code and stops
    the others; the other ranks' own collectives time out after --dist-timeout.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
