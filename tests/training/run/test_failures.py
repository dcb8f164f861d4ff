"""training/run/failures.py: how a command ends when something fails (one line, and its exit status)."""

import pytest
import torch

from training.config import ConfigError
from training.data import DataError
from training.run.failures import MEMORY_FLAGS, RunError, StoppedAtOnce, out_of_memory_message, run_main

EXPECTED = (RunError, DataError, FileNotFoundError)
WHAT = "--batch-size 64 --context-length 4096"
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes. Error code 12"


def raising(e: BaseException):
    def body() -> int:
        raise e
    return body


def memory(e: BaseException):
    return out_of_memory_message(e, torch.device("cpu"), WHAT)


def ends(body, capsys, **kw) -> tuple[int, str]:
    """The exit status and what went to stderr; nothing may go to stdout."""
    code = run_main(body, EXPECTED, **kw)
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def test_the_body_s_status_is_the_exit_status(capsys):
    assert ends(lambda: 0, capsys) == (0, "")
    assert ends(lambda: 143, capsys) == (143, "")


@pytest.mark.parametrize("error, status", [
    (ConfigError("--lr must be >= 0, got -1"), 2),  # a flag's error found late: the status of a bad flag
    (RunError("the loss became NaN at step 7"), 1),
    (DataError("--data x.bin is empty"), 1),
    (FileNotFoundError("no checkpoint at x.pt"), 1),
])
def test_config_errors_exit_2_and_expected_errors_1_with_one_line(capsys, error, status):
    assert ends(raising(error), capsys, prefix="[rank 1] ") == (status, f"[rank 1] error: {error}\n")


def test_interrupts_exit_130(capsys):
    assert ends(raising(KeyboardInterrupt()), capsys) == (130, "interrupted (Ctrl-C); nothing was saved\n")
    stopped = StoppedAtOnce("second Ctrl-C: stopped at once, without a checkpoint of this step")
    assert ends(raising(stopped), capsys) == (130, f"{stopped}\n")


@pytest.mark.parametrize("error", [RuntimeError(CPU_OOM), MemoryError()], ids=["allocator", "MemoryError"])
def test_cpu_out_of_memory_is_one_line_naming_the_flags(capsys, error):
    code, err = ends(raising(error), capsys, memory=memory)
    assert code == 1
    assert err == f"error: out of CPU memory with {WHAT}; lower {MEMORY_FLAGS}\n"
    assert "--batch-size" in MEMORY_FLAGS and "--activation-checkpointing" in MEMORY_FLAGS


def test_other_failures_keep_their_traceback(capsys):
    """A bug is not an input error: one process re-raises it, whatever the memory hook says."""
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_main(raising(RuntimeError("shape mismatch")), EXPECTED, memory=memory)
    with pytest.raises(KeyError):
        run_main(raising(KeyError("x")), EXPECTED, memory=memory)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):  # no memory hook: nothing to say about it
        run_main(raising(RuntimeError(CPU_OOM)), EXPECTED)
    assert capsys.readouterr().err == ""


def test_out_of_memory_message_knows_only_allocation_failures():
    assert out_of_memory_message(RuntimeError("shape mismatch"), torch.device("cpu"), WHAT) is None
    assert out_of_memory_message(ValueError(CPU_OOM), torch.device("cpu"), WHAT) is None
    # A CUDA out-of-memory error on the CPU path is not the CPU allocator's.
    assert out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory"), torch.device("cpu"), WHAT) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_out_of_memory_names_the_gpu_and_the_flags():
    message = out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB"),
                                    torch.device("cuda"), WHAT)
    assert message.startswith(f"out of GPU memory on {torch.cuda.get_device_name()} (")
    assert f"with {WHAT}; lower {MEMORY_FLAGS}, or use --dtype bf16 or --parallel fsdp" in message
    assert "\n" not in message
