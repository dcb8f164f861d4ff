"""The one recipe that builds a training step, used by train.py and bench_model.py.

    step = build_step(model, StepConfig(precision="bf16", compile=True, cuda_graph=True), ctx)
    loss, grad_norm = step(x, y)          # forward, backward, clipping, AdamW; gradients cleared

The order of the recipe is what makes its parts compose, as torchtitan does it:
0. with --fp8, the blocks' Linear layers become float8 ones (training.fp8), sharing their weights;
1. activation checkpointing wraps each block's forward, so that compilation traces the recomputation too;
2. regional compilation (`--compile-scope blocks`) compiles the blocks and the loss in place, before FSDP, so its
   hooks stay outside compiled code;
3. DDP or FSDP wraps the model (`training.distributed.wrap_model`); a whole-model compile wraps that;
4. AdamW comes after the wrapping, since FSDP replaces the parameters by their shards;
5. a CUDA graph captures the whole eager step (forward, backward, clipping, AdamW) after its warm-up steps.

One AdamW set-up serves both scripts (`make_optimizer`): weight decay on matrices only, betas (0.9, 0.95), fused on
CUDA, capturable under a CUDA graph, or stepped during the backward with `overlap_optimizer`. With
`optim_state_dtype="bf16"` it is training.adamw's: bf16 moments, and under bf16/fp16 autocast each Linear's
low-precision weight copy rewritten by the update (the forward then casts no weight) and clipping folded into it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from model.layers import Linear, SwiGLU
from training import distributed, fp8
from training.activation_checkpointing import checkpoint_blocks
from training.adamw import AdamW
from training.compilation import compile_regions
from training.cuda_graph import GraphedStep
from training.distributed import DistContext
from training.overlapped_optimizer import OverlappedOptimizer, step_partitions
from training.precision import DTYPES, autocast, grad_scaler

GRAPH_WARMUP = 2  # eager steps before a CUDA graph is captured (compile and autotune happen in the first)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's hyper-parameters; the defaults are train.py's flags' defaults."""

    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # matrices only
    grad_clip: float = 1.0  # the global gradient norm's bound; 0 disables clipping


@dataclass(frozen=True)
class StepConfig:
    """How a step is built: precision, compilation, memory and speed options, and the optimizer."""

    precision: str = "fp32"  # a key of training.precision.DTYPES
    compile: bool = False
    compile_scope: str = "blocks"  # training.compilation.COMPILE_SCOPES
    activation_checkpointing: bool = False
    overlap_optimizer: bool = False  # AdamW stepped during the backward (training.overlapped_optimizer)
    cuda_graph: bool = False  # the whole step captured once and replayed (training.cuda_graph)
    fp8: str = "off"  # the blocks' matmuls in float8: "tensorwise" or "rowwise" scaling (training.fp8)
    optim_state_dtype: str = "fp32"  # AdamW's moments: fp32 (torch.optim.AdamW) or bf16 (training.adamw.AdamW)
    # The batch of a step split into this many micro-batches, run one after another with their gradients summed:
    # the same update, the activations of one micro-batch. DDP and FSDP reduce the gradients after the last only.
    grad_accum_steps: int = 1
    # The global gradient norm, returned by each step (train.py logs it). Without clipping it can be skipped:
    # bench_model times the step without it, so that its --overlap-optimizer rows compare like with like.
    grad_norm: bool = True
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


def keep_weight_copies(model: nn.Module, config: StepConfig) -> dict[nn.Parameter, torch.Tensor]:
    """With bf16 optimizer state under bf16/fp16 autocast: each Linear (that writes fp32 weight gradients) keeps a
    low-precision copy of its weight, which the optimizer rewrites; {weight: copy}. Otherwise none."""
    if config.optim_state_dtype != "bf16" or config.precision == "fp32":
        return {}
    dtype = DTYPES[config.precision]
    copies = {}
    for m in model.modules():
        if isinstance(m, SwiGLU) and all(_keeps_copy(w) for w in (m.w1, m.w2, m.w3)):
            copies.update(m.keep_weight_copies(dtype))  # w1's and w3's in one tensor, for the fused matmul
        elif _keeps_copy(m) and m.weight not in copies:
            copies[m.weight] = m.keep_weight_copy(dtype)
    return copies


def _keeps_copy(m: nn.Module) -> bool:
    return isinstance(m, Linear) and m.fp32_weight_grad and m.weight.dtype == torch.float32


def make_optimizer(model: nn.Module, config: StepConfig, device: torch.device,
                   weight_copies: Optional[dict[nn.Parameter, torch.Tensor]] = None,
                   ) -> torch.optim.Optimizer | OverlappedOptimizer:
    """AdamW over `model`'s parameters (after any DDP/FSDP wrapping: FSDP's are shards); weight_copies: what
    keep_weight_copies returned, for training.adamw's AdamW to rewrite."""
    hp = config.optimizer
    # A CUDA graph replays the step as captured: the step count must live on the GPU (capturable) and the learning
    # rate be a tensor that set_lr updates in place.
    lr = torch.tensor(hp.lr, device=device) if config.cuda_graph else hp.lr

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # Decay matrices only: norm gains are scales, decaying them towards 0 fights the normalisation.
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if config.optim_state_dtype == "bf16":
            return AdamW(groups, lr=lr, betas=hp.betas, eps=hp.eps, state_dtype=torch.bfloat16,
                         weight_copies=weight_copies)
        return torch.optim.AdamW(groups, lr=lr, betas=hp.betas, eps=hp.eps, fused=device.type == "cuda",
                                 capturable=config.cuda_graph)

    if config.overlap_optimizer:
        return OverlappedOptimizer(step_partitions(model), adamw, track_grad_norm=config.grad_norm)
    return adamw(list(model.parameters()))


def set_lr(optimizer: torch.optim.Optimizer | OverlappedOptimizer, lr: float) -> None:
    """Every group's learning rate; a tensor learning rate (CUDA graphs) is written in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@dataclass
class TrainingStep:
    """A built step. `model` owns the parameters under their plain names (checkpoints, optimizer); `step_model` is
    what the forward calls: the model, DDP- or FSDP-wrapped and compiled as asked.

    `step(x, y)` runs a whole step; `loss`, `backward` and `optimizer_step` are its phases, for timing them apart.
    """

    model: nn.Module
    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, targets) -> mean loss
    optimizer: torch.optim.Optimizer | OverlappedOptimizer
    scaler: torch.amp.GradScaler
    config: StepConfig
    device: torch.device
    graphed: Optional[GraphedStep] = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.config.precision)

    def loss(self, x: torch.Tensor, y: torch.Tensor, model: Optional[Callable] = None,
             doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy, in fp32, computed inside the model: in its compiled code under compile.
        doc_ids: packed documents' ids (training/packing.py), for the model's document mask."""
        with self.autocast():
            if doc_ids is None:
                return (model or self.step_model)(x, y)
            return (model or self.step_model)(x, y, doc_ids=doc_ids)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Inside, with sync False: DDP and FSDP keep the gradients local (accumulated micro-batches but the last)."""
        ddp = getattr(self.step_model, "_orig_mod", self.step_model)  # under a whole-model compile
        if sync:
            yield
        elif isinstance(ddp, nn.parallel.DistributedDataParallel):
            with ddp.no_sync():
                yield
        elif hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 shards the model in place
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:  # one process: nothing to hold back
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """The backward (of the scaled loss under fp16); with the overlapped optimizer AdamW steps inside it."""
        self.scaler.scale(loss).backward()

    def optimizer_step(self) -> Optional[torch.Tensor]:
        """Unscale, clip, step AdamW; returns the global gradient norm (None when the config skips it). The scaler is
        a no-op unless fp16, which a CUDA graph refuses: its inf checks read values on the host."""
        if isinstance(self.optimizer, OverlappedOptimizer):  # it stepped during the backward; step() waits for it
            self.optimizer.step()
            return self.optimizer.grad_norm() if self.config.grad_norm else None
        self.scaler.unscale_(self.optimizer)
        clip = self.config.optimizer.grad_clip
        grad_norm = None
        if clip > 0 or self.config.grad_norm:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if isinstance(self.optimizer, AdamW):  # the clipping factor is applied inside its update
            scale = torch.clamp(clip / (grad_norm + 1e-6), max=1.0) if clip > 0 else None  # clip_grad_norm_'s
            self.scaler.step(self.optimizer, grad_scale=scale)
        else:
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), clip, grad_norm)
            self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm

    def eager_step(self, x: torch.Tensor, y: torch.Tensor,
                   doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """Forward, backward and optimizer without synchronising or clearing gradients: what a CUDA graph captures.
        Returns (loss,) or (loss, grad norm)."""
        n = self.config.grad_accum_steps
        if n == 1:
            loss = self.loss(x, y) if doc_ids is None else self.loss(x, y, None, doc_ids)
            self.backward(loss)
        else:
            if x.shape[0] % n:
                raise ValueError(f"grad_accum_steps {n} must divide the batch of {x.shape[0]} sequences")
            # Equal micro-batches: the mean of their mean losses is the batch's mean loss, and so are the gradients.
            chunks = zip(x.chunk(n), y.chunk(n), doc_ids.chunk(n) if doc_ids is not None else [None] * n)
            loss = x.new_zeros((), dtype=torch.float32)
            for i, (xi, yi, di) in enumerate(chunks):
                with self.gradient_sync(i == n - 1):
                    micro = self.loss(xi, yi) if di is None else self.loss(xi, yi, None, di)
                    self.backward(micro / n)
                loss = loss + micro.detach() / n
        grad_norm = self.optimizer_step()
        return (loss.detach(),) if grad_norm is None else (loss.detach(), grad_norm)

    def __call__(self, x: torch.Tensor, y: torch.Tensor,
                 doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One whole step, replayed as a CUDA graph when so built; (loss, grad norm or None), gradients cleared.
        doc_ids: packed documents' ids, as in `loss`."""
        inputs = (x, y) if doc_ids is None else (x, y, doc_ids)
        if self.graphed is not None:
            out = self.graphed(*inputs)  # sets the gradients to None itself before each eager step
        else:
            out = self.eager_step(*inputs)
            self.optimizer.zero_grad(set_to_none=True)
        return out[0], (out[1] if len(out) > 1 else None)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def match_lr_kind(self) -> None:
        """After loading an optimizer state: a checkpoint written with the other kind of learning rate (a tensor
        under a CUDA graph, a float otherwise) gets this step's kind back."""
        for group in self.optimizer.param_groups:
            lr = float(group["lr"])
            group["lr"] = torch.tensor(lr, device=self.device) if self.config.cuda_graph else lr


def build_step(model: nn.Module, config: StepConfig, ctx: Optional[DistContext] = None,
               graph_warmup: int = GRAPH_WARMUP) -> TrainingStep:
    """The step for `model` (already on its device, the same initial weights on every rank), in the recipe's order.

    `ctx` is the process's place in a DDP/FSDP group (None or --parallel none: one process). The compile scope
    `blocks` needs a TransformerLM; any other model (the Hugging Face peer) compiles as a whole. The combinations
    that cannot be built (a CUDA graph off CUDA, fp16 under FSDP, ...) are refused by training.cli's flag checks.
    """
    ctx = ctx or DistContext(device=next(model.parameters()).device)
    device = ctx.device
    if config.fp8 != "off":
        fp8.convert(model, config.fp8, device)  # first: checkpointing, compile and the optimizer see the new layers
    weight_copies = keep_weight_copies(model, config)  # before compiling: the compiled forward reads them
    if config.activation_checkpointing:
        checkpoint_blocks(model)
    if config.compile and config.compile_scope == "blocks":
        compile_regions(model)  # after checkpointing (the recomputed forward is compiled), before FSDP
    step_model = distributed.wrap_model(model, ctx, DTYPES[config.precision])  # `model` keeps the plain names
    if config.compile and config.compile_scope == "model":
        step_model = torch.compile(step_model, dynamic=False)
    # after wrapping: FSDP replaces the parameters by shards
    optimizer = make_optimizer(model, config, device, weight_copies)
    step = TrainingStep(model, step_model, optimizer, grad_scaler(device, config.precision), config, device)
    if config.cuda_graph:
        step.graphed = GraphedStep(step.eager_step, optimizer, warmup=graph_warmup)
    return step
