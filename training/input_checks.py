"""Checks of a run's inputs, each giving one line that names the file or flag and the problem.

They run before anything is built or written: the flags at once, the attention backend against the device before
the model exists, the data files when they are opened.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from attention import backend_names, why_not


class InputError(ValueError):
    """A data file that cannot be trained on; the message names it."""


# --------------------------------------------------------------------------------------------------- flags

# Flags that count something and where 0 has a meaning of its own (see their --help).
_NON_NEGATIVE = {
    "eval_every": "0: evaluate only at the end",
    "ckpt_every": "0: checkpoint only at the end",
    "grad_clip": "0 disables clipping",
    "warmup_steps": "0: no warm-up",
    "lr": None,
    "min_lr": None,
    "weight_decay": None,
}


def flag_problem(args: argparse.Namespace) -> Optional[str]:
    """The first negative or contradictory flag, as the message for argparse's error(); None if all are fine."""
    for name, meaning in _NON_NEGATIVE.items():
        value = getattr(args, name, None)
        if value is not None and value < 0:
            flag = "--" + name.replace("_", "-")
            return f"{flag} must be >= 0{f' ({meaning})' if meaning else ''}, got {value:g}"
    keep = getattr(args, "keep_checkpoints", None)
    if keep is not None and keep < 1:
        return f"--keep-checkpoints must be >= 1 (checkpoints kept on disk), got {keep}"
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        return "--resume continues the run in --out and --overwrite moves it aside: pass one of them"
    return None


def flag_warnings(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Flags that are legal but probably not meant, each as one line; `given` names the flags (dests) that were
    passed rather than left at their defaults (a default warm-up longer than a short test run is no surprise)."""
    warnings = []
    if "warmup_steps" in given and args.warmup_steps >= args.steps > 0:
        warnings.append(f"warning: --warmup-steps {args.warmup_steps} is not shorter than the run (--steps "
                        f"{args.steps}): the learning rate never reaches --lr {args.lr:g}")
    window = getattr(args, "window", None)
    if window is not None and "L" not in args.window_pattern:
        warnings.append(f"warning: --window-pattern {args.window_pattern} has no local layer (L): --window {window} "
                        "changes no layer")
    elif window is not None and window >= args.context_length:
        warnings.append(f"warning: --window {window} is not shorter than --context-length {args.context_length}: the "
                        "local layers see their whole context, as without a window")
    return warnings


# ----------------------------------------------------------------------------------------- attention backend


def backend_problem(attn: str, device: torch.device | str, dtype: torch.dtype, d_head: int,
                    training: bool = True, kv_groups: int = 1, window: Optional[int] = None,
                    softcap: Optional[float] = None, documents: bool = False) -> Optional[str]:
    """Why backend `attn` cannot run the model's attention (d_head, dtype, device, with a backward when training, and
    its variants: query heads per key/value head, a window, softcap, packed documents) here, naming the backends
    that can; None if it can. Cheap: a few tiny tensors, no model."""
    device = torch.device(device)
    doc_ids = torch.zeros(1, 128, dtype=torch.int32, device=device) if documents else None

    def reason(name: str) -> Optional[str]:
        with torch.enable_grad() if training else torch.no_grad():
            # 128 positions: a length every backend's tiles take whole (flex's GQA needs it on CUDA)
            q = torch.zeros(1, kv_groups, 128, d_head, device=device, dtype=dtype, requires_grad=training)
            k = torch.zeros(1, 1, 128, d_head, device=device, dtype=dtype, requires_grad=training)
            return why_not(name, q, k, k, True, window=window, softcap=softcap, doc_ids=doc_ids)

    problem = reason(attn)
    if problem is None:
        return None
    usable = [name for name in backend_names() if reason(name) is None]
    where = f"{device.type} with {str(dtype).removeprefix('torch.')}{' for training' if training else ''}"
    return (f"--attn {attn} cannot run on {where}: {problem}; "
            f"backends that can: {', '.join(usable) if usable else 'none'}")


# ------------------------------------------------------------------------------------------------- data


def text_problem(data: bytes) -> Optional[str]:
    """Why `data` is not UTF-8 text, in a few words; None if it is."""
    if not data:
        return "is empty"
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "is UTF-32 text, not UTF-8 (it starts with a UTF-32 byte-order mark); convert it to UTF-8"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "is UTF-16 text, not UTF-8 (it starts with a UTF-16 byte-order mark); convert it to UTF-8"
    head = data[:4096]
    if head.count(b"\0") > len(head) // 4 and (head[0::2].count(0) == 0 or head[1::2].count(0) == 0):
        # ASCII text in UTF-16 without a byte-order mark: every other byte is 0.
        return "looks like UTF-16 text, not UTF-8 (every other byte is 0); convert it to UTF-8"
    if b"\0" in data:
        return "is binary, not text (it holds NUL bytes)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    return None


def check_text(path: Path, data: bytes) -> None:
    """A text file given as --data must be UTF-8; byte-level training reads its bytes."""
    problem = text_problem(data)
    if problem is not None:
        raise InputError(f"--data {path} {problem}")


def check_bin_size(path: Path) -> None:
    """A .bin token file holds uint16 ids: a whole number of 2-byte values, at least one."""
    size = path.stat().st_size
    if size == 0:
        raise InputError(f"--data {path} is empty")
    if size % 2:
        raise InputError(f"--data {path} has an odd number of bytes ({size:,}): a .bin token file holds uint16 "
                         "ids of 2 bytes each (a text file should not end in .bin)")


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str = "the data") -> None:
    """Every token id must index the embedding: 0 <= id < vocab_size."""
    if len(tokens) == 0:
        raise InputError(f"{source} holds no tokens")
    if np.issubdtype(tokens.dtype, np.signedinteger):
        low = int(tokens.min())
        if low < 0:
            where = int(np.argmax(np.asarray(tokens) < 0))
            raise InputError(f"{source} holds token id {low} (the first negative one at position {where:,}); "
                             f"ids must be in [0, {vocab_size})")
    top = int(tokens.max())
    if top >= vocab_size:
        raise InputError(f"{source} holds token id {top}, but the model's vocabulary is {vocab_size}; "
                         f"pass --vocab-size {top + 1} or more")
