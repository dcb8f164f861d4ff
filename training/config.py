"""The configuration of a run: one typed tree, its defaults and its rules, resolved once for every script.

    Config
      model      ModelConfig (model/config.py): what the model is
      execution  how it runs: attention backend, precision, compile, CUDA graph, float8, parallelism, device
      optim      the optimizer by name (training/optim) and its learning-rate schedule
      data       what it trains on, and in batches of how many sequences
      run        how long, where its files go, and how often it evaluates, logs and checkpoints

Every field is one command-line flag of the same name (training/cli.py). `resolve` fills the defaults that depend on
the machine (device, precision, compile, CUDA graph, warm-up) and checks every rule, each written once here or in
the module that owns it, with messages that name the flags. train.py, bench_model.py and evaluate.py go through it;
sample.py takes its defaults from here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch

from model import ModelConfig
from training.fp8 import RECIPES as FP8_RECIPES
from training.parallel.activation_checkpointing import POLICIES as RECOMPUTE_POLICIES

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARALLEL_MODES = ("none", "ddp", "fsdp")
WANDB_MODES = ("offline", "online", "disabled")


class ConfigError(ValueError):
    """A configuration that cannot run; the one-line message names the flags."""


def option(default: Any, help: str, main: bool = False, choices: Optional[tuple] = None,
           flag: Optional[str] = None) -> Any:
    """A field of the tree: its default, its --help text, whether --help lists it (`main`), its valid values, and
    its flag when that is not the field's own name."""
    return field(default=default, metadata={"help": help, "main": main, "choices": choices, "flag": flag})


@dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs; none of it changes the weights a step computes beyond rounding."""

    attn: str = option("sdpa", "attention backend by name (attention/registry.py; python -c 'import attention; print(attention.backend_names())')", main=True)
    dtype: Optional[str] = option(None, "compute precision: bf16/fp16 autocast over fp32 master weights (fp16 adds a "
                                        "gradient scaler); default bf16 on CUDA, fp32 on the CPU", True, tuple(DTYPES))
    compile: Optional[bool] = option(None, "torch.compile each block and the loss; default on with CUDA", True)
    cuda_graph: Optional[bool] = option(None, "capture the whole step once as a CUDA graph and replay it; default on "
                                              "where it applies (CUDA, one process, not fp16, an optimizer that "
                                              "can be captured)", True)
    fp8: str = option("off", "the blocks' Linear layers in float8 (torchao): tensorwise or rowwise scaling; needs "
                             "bf16 and float8 matmuls (emulated on the CPU)", True, FP8_RECIPES)
    activation_checkpointing: bool = option(False, "recompute each block in the backward instead of keeping its "
                                                   "activations", True)
    recompute: str = option("full", "with --activation-checkpointing, what the backward recomputes: full (the "
                                    "whole block) or selective (all but the outputs of matmuls and attention, "
                                    "which are kept)", choices=RECOMPUTE_POLICIES)
    grad_accum_steps: int = option(1, "split each step's batch into this many micro-batches run one after another "
                                      "(the same update, a micro-batch's activation memory)")
    parallel: str = option("none", "none: one process; ddp or fsdp under torchrun (--batch-size is then the global "
                                   "batch)", True, PARALLEL_MODES)
    dist_timeout: float = option(600.0, "seconds a collective waits for the other ranks before the run fails")
    device: Optional[str] = option(None, "torch device; default cuda if available, else cpu", True)
    deterministic: bool = option(False, "bitwise-reproducible steps: torch.use_deterministic_algorithms(True), so "
                                        "an operator without a deterministic kernel stops the run instead of "
                                        "varying it (flash's backward runs its deterministic kernels)")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer (training/optim registers them by name) and the learning rate's warm-up and cosine decay."""

    optimizer: str = option("adamw", "adamw (fp32 moments), adamw-bf16 (bf16 moments that also write the bf16 weight "
                                     "copies), muon (Muon for the blocks' matrices, AdamW for the rest), or any name "
                                     "in training/optim", True)
    lr: float = option(6e-4, "peak learning rate", True)
    min_lr: float = option(6e-5, "learning rate at the end of the cosine decay")
    warmup_steps: Optional[int] = option(None, "linear warm-up steps; default 100, at most a tenth of the run", True)
    weight_decay: float = option(0.1, "decoupled weight decay of the matrices")
    embed_lr_scale: float = option(1.0, "the embedding's learning rate as a multiple of --lr (its weight decay divided "
                                        "by as much: the same shrinkage a step)")
    grad_clip: float = option(1.0, "clip the global gradient norm (0: none, and the optimizer then steps each "
                                   "parameter during the backward)", True)


@dataclass(frozen=True)
class DataConfig:
    """What a run trains on (training/data); the model's context length sets the rows' length."""

    data: Optional[str] = option(None, "a prepared directory (prepare_data.py), a text file or directory (bytes), a "
                                       ".bin/.npy token file, or 'synthetic'; default this Python's standard library "
                                       "sources as bytes", True)
    vocab_size: Optional[int] = option(None, "vocabulary; default the data's (256 for bytes, the tokenizer's, 10000 "
                                             "for synthetic tokens)")
    batch_size: int = option(16, "sequences per optimizer step (all ranks together)", True)
    pack_documents: bool = option(False, "prepared data: rows start at document starts; attention stays within each "
                                         "document and RoPE restarts at each", True)
    data_changed: bool = option(False, "--resume on data other than the run's (another corpus or tokenizer): meant, "
                                       "and recorded in the run's data.json and metrics")


@dataclass(frozen=True)
class RunConfig:
    """A run's length, its output directory and the cadence of its evaluation, logs and checkpoints."""

    steps: int = option(1000, "optimizer steps in total", True)
    out: str = option("runs/train", "output directory: metrics, checkpoints, config.json, W&B run", True)
    resume: bool = option(False, "continue the run in --out from its newest good checkpoint, with its configuration "
                                 "(flags given override what may change)", True)
    overwrite: bool = option(False, "start over in an --out that holds a run (moved to <out>.old-<time>)", True)
    init_from: Optional[str] = option(None, "start from the weights (and tokenizer) of a local Hugging Face Llama "
                                            "directory, whose config.json gives the model (training/init_from.py); "
                                            "a resumed run keeps its own checkpoint")
    eval_every: int = option(200, "validation loss and bits per byte every N steps (0: at the end)", True)
    eval_batches: int = option(10, "validation batches per evaluation")
    log_every: int = option(10, "log metrics every N steps")
    ckpt_every: int = option(500, "checkpoint every N steps (0: at the end)")
    keep_checkpoints: int = option(2, "checkpoints kept, the newest ones (0: write none)")
    seed: int = option(0, "seed of the initial weights and the data order", True)
    wandb: str = option("offline", "W&B: offline writes <out>/wandb for a later `wandb sync`", choices=WANDB_MODES)
    wandb_project: str = option("flash-lm", "W&B project")
    profile: Optional[str] = option(None, "record --profile-steps steps after the warm-up under torch.profiler: each "
                                          "rank's Chrome trace and kernel table in this directory (docs/profiling.md)")
    profile_steps: int = option(3, "steps --profile records")
    allow_pickle: bool = option(False, "load checkpoints of earlier versions, written with pickle (torch.save): "
                                       "unpickling can run code the file carries, so only for files you trust")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the `small` preset
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in fields(self)}

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with fields replaced per section: config.replace(run={"steps": 10}, execution={"attn": "flash"})."""
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **values)
                                            for name, values in sections.items()})


SECTIONS = {"model": ModelConfig, "execution": ExecutionConfig, "optim": OptimConfig, "data": DataConfig,
            "run": RunConfig}


def flag_of(section: str, name: str) -> str:
    """The command-line flag of a field, e.g. --cuda-graph."""
    meta = {f.name: f.metadata for f in fields(SECTIONS[section])}[name]
    return "--" + (meta.get("flag") or name).replace("_", "-")


def as_flags(message: str) -> str:
    """A message written with field names, spelled with the flags that set them ("n_kv_heads must divide n_heads"
    -> "--n-kv-heads must divide --n-heads")."""
    names = sorted({f.name for cls in SECTIONS.values() for f in fields(cls)}, key=len, reverse=True)
    return re.sub(rf"(?<![-\w])({'|'.join(names)})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


# ------------------------------------------------------------------------------------------------ resolution


@dataclass(frozen=True)
class Resolved:
    """A config with every automatic default filled, what was chosen (in words), and warnings."""

    config: Config
    choices: list[str]
    warnings: list[str]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(device: Optional[str], parallel: str = "none") -> torch.device:
    """--device as a torch.device (default: CUDA when there is a GPU); a CUDA device without one is an error."""
    try:
        parsed = torch.device(device or default_device())
    except RuntimeError as e:
        raise ConfigError(f"--device: {e}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for, but no CUDA GPU is visible; use --device cpu"
                          f"{' (the ranks then talk over gloo)' if parallel != 'none' else ''}")
    return parsed


def default_dtype(device: torch.device) -> str:
    """The precision when none is asked: bf16 autocast on CUDA, fp32 elsewhere."""
    return "bf16" if device.type == "cuda" else "fp32"


def graph_obstacle(device: torch.device, parallel: str, dtype: str, activation_checkpointing: bool,
                   optimizer: str) -> Optional[str]:
    """Why the step is not captured as a CUDA graph by default, or None."""
    from training.optim import get_optimizer

    if device.type != "cuda":
        return "CUDA graphs need a GPU"
    if parallel != "none":
        return f"not captured under --parallel {parallel}"
    if dtype == "fp16":
        return "not captured with fp16, whose gradient scaler checks for inf on the host"
    if not get_optimizer(optimizer).capturable:
        # A graph would replay the learning rate it saw at capture: the schedule would stop.
        return f"not captured with --optimizer {optimizer}, whose step reads its learning rate on the host"
    if activation_checkpointing:
        return "not captured with --activation-checkpointing"
    return None


def overlaps_backward(config: Config, world_size: int = 1) -> bool:
    """Whether the optimizer steps each parameter during the backward: only without clipping (which needs every
    gradient first), in one process, without accumulation or fp16's loss scale, and if the optimizer can."""
    from training.optim import get_optimizer

    ex = config.execution
    return (config.optim.grad_clip == 0 and world_size == 1 and ex.parallel == "none" and ex.grad_accum_steps == 1
            and ex.dtype != "fp16" and get_optimizer(config.optim.optimizer).steps_in_backward)


def _check_values(config: Config) -> None:
    """Each field alone: a known name, a value in its range."""
    from attention import backend_names
    from training.optim import optimizer_names

    ex, op, da, ru = config.execution, config.optim, config.data, config.run
    for section in (ex, op, ru):
        for f in fields(section):
            choices, value = f.metadata.get("choices"), getattr(section, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"--{f.name.replace('_', '-')}: unknown value {value!r}; valid: {', '.join(choices)}")
    if ex.attn not in backend_names():
        raise ConfigError(f"unknown --attn {ex.attn!r}; valid: {', '.join(backend_names())}")
    if op.optimizer not in optimizer_names():
        raise ConfigError(f"unknown --optimizer {op.optimizer!r}; valid: {', '.join(optimizer_names())}")
    at_least = {"--batch-size": (da.batch_size, 1), "--steps": (ru.steps, 1), "--eval-batches": (ru.eval_batches, 1),
                "--log-every": (ru.log_every, 1), "--grad-accum-steps": (ex.grad_accum_steps, 1),
                "--vocab-size": (da.vocab_size, 1), "--eval-every": (ru.eval_every, 0),
                "--ckpt-every": (ru.ckpt_every, 0), "--keep-checkpoints": (ru.keep_checkpoints, 0),
                "--profile-steps": (ru.profile_steps, 1),
                "--grad-clip": (op.grad_clip, 0), "--warmup-steps": (op.warmup_steps, 0), "--lr": (op.lr, 0),
                "--min-lr": (op.min_lr, 0), "--weight-decay": (op.weight_decay, 0)}
    for flag, (value, least) in at_least.items():
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value:g}")
    if op.embed_lr_scale <= 0:
        raise ConfigError(f"--embed-lr-scale must be > 0, got {op.embed_lr_scale:g}")
    if ex.dist_timeout <= 0:
        raise ConfigError(f"--dist-timeout must be > 0 seconds, got {ex.dist_timeout:g}")
    if op.min_lr > op.lr:
        raise ConfigError(f"--min-lr ({op.min_lr:g}) is larger than --lr ({op.lr:g})")
    if ru.profile is not None:
        _check_profile_dir(Path(ru.profile))
    if ru.resume and ru.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite moves it aside: pass one of them")
    problem = config.model.problem()
    if problem:
        raise ConfigError(as_flags(problem))


def _check_profile_dir(path: Path) -> None:
    """--profile's directory: one, or one this process may create (its nearest existing parent is writable)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--profile {path}: exists and is not a directory")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--profile {path}: {existing} is not writable")


def _check_combinations(config: Config, device: torch.device, world_size: int) -> None:
    """What the step cannot build together (training/step.py), by the flags that ask for it."""
    from training import fp8
    from training.optim import get_optimizer

    ex, op = config.execution, config.optim
    if ex.parallel == "fsdp" and not get_optimizer(op.optimizer).shards:
        raise ConfigError(f"--optimizer {op.optimizer} updates whole parameters; --parallel fsdp shards them: use "
                          "--parallel ddp or --optimizer adamw")
    if ex.parallel == "fsdp" and ex.dtype == "fp16":
        raise ConfigError("--parallel fsdp supports --dtype bf16 or fp32 (fp16 would need a sharded gradient scaler)")
    if ex.recompute != "full" and not ex.activation_checkpointing:
        raise ConfigError(f"--recompute {ex.recompute} says what --activation-checkpointing recomputes: add "
                          "--activation-checkpointing")
    if ex.dtype == "fp16" and device.type != "cuda":
        raise ConfigError("--dtype fp16 needs a CUDA device (the gradient scaler is CUDA-only); use bf16 or fp32")
    if ex.cuda_graph:
        obstacle = graph_obstacle(device, ex.parallel, ex.dtype, False, op.optimizer)
        if obstacle:
            raise ConfigError(f"--cuda-graph: {obstacle}")
    problem = fp8.problem(ex.fp8, device, ex.dtype, config.model.d_model)
    if problem:
        raise ConfigError(problem)
    per_rank, rem = divmod(config.data.batch_size, world_size)
    if rem:
        raise ConfigError(f"--batch-size {config.data.batch_size} (the global batch) is not divisible by the "
                          f"{world_size} ranks; pass a multiple of {world_size}")
    if per_rank % ex.grad_accum_steps:
        raise ConfigError(f"--grad-accum-steps {ex.grad_accum_steps} must divide the sequences per rank and step "
                          f"({per_rank})")


def backend_problem(attn: str, device: torch.device | str, dtype: torch.dtype, d_head: int, training: bool = True,
                    kv_groups: int = 1, window: Optional[int] = None, softcap: Optional[float] = None,
                    documents: bool = False) -> Optional[str]:
    """Why backend `attn` cannot run a model's attention (d_head, dtype, device, a backward when training, and its
    variants) here, naming the backends that can; None if it can. Cheap: a few tiny tensors, no model."""
    from attention import backend_names, why_not

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


def _check_attention(config: Config, device: torch.device, training: bool) -> None:
    m = config.model
    problem = backend_problem(config.execution.attn, device, DTYPES[config.execution.dtype], m.d_head, training,
                              kv_groups=m.n_heads // m.kv_heads, window=m.window, softcap=m.attn_softcap,
                              documents=config.data.pack_documents)
    if problem:
        raise ConfigError(problem)


def _speed_defaults(ex: ExecutionConfig, device: torch.device,
                    optimizer: str = "adamw") -> tuple[ExecutionConfig, list[str]]:
    """The fast path wherever it applies, for each of dtype, compile and cuda_graph left unset; what was chosen."""
    cuda = device.type == "cuda"
    dtype = ex.dtype or default_dtype(device)
    compile_ = ex.compile if ex.compile is not None else cuda and torch._dynamo.is_dynamo_supported()
    choices = [f"{dtype} {'autocast over fp32 weights' if dtype != 'fp32' else 'throughout'}"]
    if ex.compile is None and not compile_:
        choices.append("eager (--compile compiles" + (", which pays on GPUs)" if not cuda else ")"))
    else:
        choices.append("compiled" if compile_ else "eager")
    graph = ex.cuda_graph
    if graph is None:
        obstacle = graph_obstacle(device, ex.parallel, dtype, ex.activation_checkpointing, optimizer)
        graph = obstacle is None
        choices.append("each step replayed as one CUDA graph" if graph else f"no CUDA graph ({obstacle})")
    elif graph:
        choices.append("each step replayed as one CUDA graph")
    return dataclasses.replace(ex, dtype=dtype, compile=compile_, cuda_graph=graph, device=str(device)), choices


def _warnings(config: Config, explicit: frozenset[str]) -> list[str]:
    """Settings that are legal but probably not meant, each as one line."""
    m, op, steps = config.model, config.optim, config.run.steps
    out = []
    if "warmup_steps" in explicit and op.warmup_steps >= steps:
        out.append(f"warning: --warmup-steps {op.warmup_steps} is not shorter than the run (--steps {steps}): the "
                   f"learning rate never reaches --lr {op.lr:g}")
    if m.window is not None and "L" not in m.window_pattern:
        out.append(f"warning: --window-pattern {m.window_pattern} has no local layer (L): --window {m.window} changes "
                   "no layer")
    elif m.window is not None and m.window >= m.context_length:
        out.append(f"warning: --window {m.window} is not shorter than --context-length {m.context_length}: the local "
                   "layers see their whole context")
    if "profile_steps" in explicit and config.run.profile is None:
        out.append(f"warning: --profile-steps {config.run.profile_steps} records nothing without --profile DIR")
    return out


def default_warmup_steps(steps: int) -> int:
    """The learning rate's linear warm-up when none is asked: 100 steps, at most a tenth of the run."""
    return min(100, steps // 10)


def world_size_from_env(parallel: str) -> int:
    """The number of ranks torchrun starts (WORLD_SIZE), 1 for one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) if parallel != "none" else 1


def resolve(config: Config, explicit: frozenset[str] = frozenset(), world_size: Optional[int] = None,
            training: bool = True) -> Resolved:
    """Fill the automatic defaults and check every rule; ConfigError names the first broken one.

    explicit: the fields the user set (flags or --config), which decides some warnings. world_size: the ranks
    (default: torchrun's WORLD_SIZE under --parallel). training: check the attention backward too."""
    _check_values(config)
    ex = config.execution
    device = parse_device(ex.device, ex.parallel)
    if ex.parallel != "none" and device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    world = world_size or world_size_from_env(ex.parallel)
    execution, choices = _speed_defaults(ex, device, config.optim.optimizer)
    warmup = config.optim.warmup_steps
    if warmup is None:
        warmup = default_warmup_steps(config.run.steps)
    config = dataclasses.replace(config, execution=execution,
                                 optim=dataclasses.replace(config.optim, warmup_steps=warmup))
    _check_combinations(config, device, world)
    _check_attention(config, device, training)
    if overlaps_backward(config, world):
        choices.append(f"{config.optim.optimizer} stepped during the backward (no clipping)")
    if config.execution.deterministic:
        choices.append("deterministic algorithms: bitwise-reproducible steps")
    return Resolved(config, choices, _warnings(config, explicit))
