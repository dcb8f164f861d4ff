"""How a command ends when something fails: one line naming the problem, and the exit status.

Errors of input (a flag, a file, a directory in use, data that does not fit) exit 1 with their own message; a stop
that saved a checkpoint exits 128 + the signal; running out of memory, on the GPU or the CPU, names the flags that
lower it. Nothing here prints a traceback for a failure a user can act on.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable, Optional

import torch

from training.config import ConfigError
from training.metrics import cuda_memory_gib


class RunError(RuntimeError):
    """A run that must stop with a message (bad input found late, a loss that became NaN); exit status 1."""


class StoppedAtOnce(Exception):
    """A second Ctrl-C stopped the run without a checkpoint; exit status 130."""


MEMORY_FLAGS = "--batch-size, --context-length or --size, or add --activation-checkpointing"


def is_cpu_oom(e: BaseException) -> bool:
    """The CPU allocator's failure, which PyTorch raises as a plain RuntimeError."""
    return isinstance(e, (RuntimeError, MemoryError)) and (
        isinstance(e, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(e))


def out_of_memory_message(e: BaseException, device: torch.device, what: str,
                          lower: str = MEMORY_FLAGS) -> Optional[str]:
    """The one line for an allocation that did not fit (`what`: the configuration, in flags; `lower`: the flags that
    lower it); None if `e` is not one."""
    if isinstance(e, torch.OutOfMemoryError) and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 1024**3
        figures = ", ".join(f"{k} {v:.2f}" for k, v in cuda_memory_gib(device).items())
        more = ", or use --dtype bf16 or --parallel fsdp over more GPUs" if lower == MEMORY_FLAGS else ""
        return f"out of GPU memory on {torch.cuda.get_device_name(device)} ({total:.1f} GiB; {figures}) with " \
               f"{what}; lower {lower}{more}"
    if is_cpu_oom(e):
        return f"out of CPU memory with {what}; lower {lower}"
    return None


def run_main(body: Callable[[], int], expected: tuple[type[BaseException], ...], prefix: str = "",
             memory: Optional[Callable[[BaseException], Optional[str]]] = None, distributed: bool = False) -> int:
    """Run a script's body: its exit status, or one line and 2 for a flag's error, 1 for an expected error or memory
    that ran out, 130 after a second Ctrl-C or a Ctrl-C before any work was saved. `distributed`: a rank of several, whose failed
    collective ends the process at once (training.parallel.distributed.exit_now)."""
    try:
        return body()
    except StoppedAtOnce as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"{prefix}interrupted (Ctrl-C); nothing was saved", file=sys.stderr)
        return 130
    except ConfigError as e:  # a flag, found late
        print(f"{prefix}error: {e}", file=sys.stderr)
        return 2
    except expected as e:
        print(f"{prefix}error: {e}", file=sys.stderr)
        return 1
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        message = memory(e) if memory else None
        if message is not None:
            print(f"{prefix}error: {message}", file=sys.stderr)
            return 1
        if not distributed:
            raise
        _collective_failed(e, prefix)


def _collective_failed(e: BaseException, prefix: str) -> None:
    """A rank whose collective failed: say so and leave at once. Returning would release its DDP/FSDP state, which
    waits on its peers: forever behind a stalled one."""
    from training.parallel.distributed import exit_now

    # A collective that timed out inside DDP's backward arrives as a plain RuntimeError from gloo.
    if isinstance(e, torch.distributed.DistError) or "Timed out" in str(e):
        print(f"{prefix}error: a collective failed; another rank probably died, or stalled longer than "
              f"--dist-timeout. Its own error is in its output (torchrun names the failed rank).\n"
              f"{type(e).__name__}: {e}", file=sys.stderr)
    else:
        traceback.print_exc()
    exit_now(1)
