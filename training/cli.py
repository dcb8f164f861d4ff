"""Command-line flags that train.py and bench_model.py share, defined and checked once.

Each script keeps its own defaults where its job differs (train.py's --batch-size is the global batch of a run,
bench_model.py's the per-GPU batch of a timing), but a flag both accept is spelled, explained and validated here.
"""

from __future__ import annotations

import argparse
import re
from typing import Optional

import torch

from training import distributed
from training.compilation import COMPILE_SCOPES
from training.step import OptimizerConfig

_OPT = OptimizerConfig()


def add_model_shape_flags(group: argparse._ArgumentGroup, what: str) -> None:
    """--d-model --n-layers --n-heads --d-ff; `what` says how they apply ("override the preset's", "custom size:")."""
    group.add_argument("--d-model", type=int, help=f"{what} width (d_model)")
    group.add_argument("--n-layers", type=int, help=f"{what} number of blocks")
    group.add_argument("--n-heads", type=int, help=f"{what} number of attention heads")
    group.add_argument("--d-ff", type=int, help=f"{what} SwiGLU hidden size")


def add_attention_variant_flags(group: argparse._ArgumentGroup) -> None:
    """--n-kv-heads --window --window-pattern --attn-softcap (attention/registry.py's variants)."""
    group.add_argument("--n-kv-heads", type=int,
                       help="key/value heads: grouped-query attention (default: as many as --n-heads)")
    group.add_argument("--window", type=int, help="sliding-window attention of this many keys in local layers")
    group.add_argument("--window-pattern", default="L",
                       help="local (L) and global (G) layers, repeated over the blocks, e.g. LLLG: three layers "
                            "with --window, then one with full attention (default L: every layer)")
    group.add_argument("--attn-softcap", type=float, help="cap attention scores at c * tanh(s / c) (Gemma 2: 50)")


def add_weight_grads_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--weight-grads", choices=["fp32", "autocast"], default="fp32",
                       help="under bf16/fp16 autocast, Linear weight gradients written in fp32 by their matmul "
                            "(default) or as plain autocast does (low dtype, then cast)")


def add_residual_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--residual", choices=["fp32", "autocast"], default="fp32",
                       help="under bf16/fp16 autocast, the residual stream in fp32 (default, as autocast leaves it) "
                            "or in autocast's dtype (as a model with bf16 weights runs it): half the bytes for each "
                            "residual add and RMSNorm")


def add_fused_rope_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--fused-rope", choices=["on", "off"], default="on",
                       help="on CUDA, RoPE and the split of the qkv projection into heads in one Triton kernel each "
                            "way (default on; off: PyTorch ops, which torch.compile fuses into three)")


def add_fused_gate_up_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--fused-gate-up", choices=["on", "off"], default="on",
                       help="under bf16/fp16 autocast with fp32 weight gradients, SwiGLU's w1 and w3 as one matmul "
                            "against their concatenated weights, forward and backward (default on; off: two)")


def add_compile_scope_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="blocks",
                       help="what --compile compiles: blocks (each block, all reusing one graph, so compile time does "
                            "not grow with depth, and the LM head with the loss, as torchtitan) or model (the whole "
                            "model as one graph)")


def add_optimizer_flags(group: argparse._ArgumentGroup) -> None:
    """AdamW's hyper-parameters, with training.step.OptimizerConfig's defaults."""
    group.add_argument("--lr", type=float, default=_OPT.lr, help="peak learning rate")
    group.add_argument("--weight-decay", type=float, default=_OPT.weight_decay,
                       help="AdamW weight decay (matrices only)")
    group.add_argument("--grad-clip", type=float, default=_OPT.grad_clip,
                       help="clip the global gradient norm; 0 disables")


# AdamW's moments: torch.optim.AdamW's fp32, or training.adamw's bf16 (training.step.StepConfig.optim_state_dtype).
OPTIM_STATE_DTYPES = ("fp32", "bf16")


def add_optim_state_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--optim-state-dtype", choices=OPTIM_STATE_DTYPES, default="fp32",
                       help="AdamW's moments: fp32 (default, torch.optim.AdamW) or bf16 (training/adamw.py: 8 bytes a "
                            "parameter less to move and keep; its update also writes the bf16 copy of each weight "
                            "that the forward reads, and applies the clipping factor)")


def add_device_flag(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="torch device (default cuda if available, else cpu)")


def add_parallel_flags(group: argparse._ArgumentGroup, parallel_help: str, timeout_s: float,
                       timeout_help: str) -> None:
    group.add_argument("--parallel", choices=distributed.PARALLEL_MODES, default="none", help=parallel_help)
    group.add_argument("--dist-timeout", type=float, default=timeout_s, help=timeout_help)


# ModelConfig's fields that train.py sets from flags of the same name.
_CONFIG_FLAGS = ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size", "context_length", "n_kv_heads",
                 "window_pattern", "window", "attn_softcap")


def config_error_as_flags(message: str) -> str:
    """ModelConfig's error with its field names spelled as the flags that set them ("n_kv_heads must divide n_heads"
    -> "--n-kv-heads must divide --n-heads")."""
    fields = "|".join(sorted(_CONFIG_FLAGS, key=len, reverse=True))
    return re.sub(rf"\b({fields})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def check_at_least(p: argparse.ArgumentParser, args: argparse.Namespace, least: int, *names: str) -> None:
    """Each named flag (dest names) must be >= least."""
    for name in names:
        value = getattr(args, name)
        if value < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def check_device(p: argparse.ArgumentParser, device: str, parallel: str = "none") -> torch.device:
    """The --device as a torch.device; a CUDA device without a visible GPU is an error."""
    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {device} asked for, but no CUDA GPU is visible; use --device cpu"
                f"{' (the ranks then talk over gloo)' if parallel != 'none' else ''}")
    return parsed


def check_dist_timeout(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dist_timeout <= 0:
        p.error(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")


def check_step_flags(p: argparse.ArgumentParser, device: torch.device, parallel: str, precisions: list[str],
                     cuda_graph: bool, overlap_optimizer: bool, grad_clip: Optional[float] = None,
                     optim_state_dtypes: tuple[str, ...] | list[str] = ("fp32",)) -> None:
    """The combinations training.step.build_step cannot build, named by their flags (exit status 2).

    `precisions` are the --dtype values the run uses; `grad_clip` is None where the script never clips."""
    if parallel == "fsdp" and "bf16" in optim_state_dtypes:
        p.error("--optim-state-dtype bf16 updates whole parameters and their weight copies; --parallel fsdp shards "
                "them: use --parallel ddp or the default fp32 state")
    if parallel == "fsdp" and "fp16" in precisions:
        p.error("--parallel fsdp supports --dtype bf16 or fp32 (fp16 would need a sharded gradient scaler)")
    if "fp16" in precisions and device.type != "cuda":
        p.error("--dtype fp16 needs a CUDA device (the gradient scaler is CUDA-only); use bf16 or fp32 on the CPU")
    if overlap_optimizer:
        if grad_clip is not None and grad_clip > 0:
            p.error("--overlap-optimizer steps each parameter as soon as its gradient exists, before the global "
                    "norm is known: add --grad-clip 0")
        if parallel != "none":
            p.error("--overlap-optimizer is for one process (DDP and FSDP reduce gradients after its hooks); "
                    "drop --parallel")
        if "fp16" in precisions:
            p.error("--overlap-optimizer supports --dtype bf16 or fp32 (fp16's loss scale is checked for inf "
                    "after the whole backward)")
    if cuda_graph:
        if device.type != "cuda":
            p.error(f"--cuda-graph needs a CUDA device, got --device {device}")
        if parallel != "none":
            p.error("--cuda-graph is for one process; drop --parallel")
        if "fp16" in precisions:
            p.error("--cuda-graph supports --dtype bf16 or fp32 (fp16's gradient scaler checks for inf on the host)")
