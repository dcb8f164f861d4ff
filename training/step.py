"""The one recipe that builds a training step, for train.py and bench_model.py.

    step = build_step(model, config, ctx)   # config: a resolved training.config.Config
    loss, grad_norm = step(x, y)            # forward, backward, clipping, optimizer; gradients cleared

The order is what makes the parts compose, as torchtitan does it:
0. with --fp8, the blocks' Linear layers become float8 ones (training.fp8), sharing their weights, before FSDP shards
   them (under FSDP with tensorwise scaling, each optimizer step then precomputes the float8 scales of the weights);
1. activation checkpointing wraps each block's forward, so that compilation traces the recomputation too;
2. regional compilation compiles the blocks and the loss in place, before FSDP, so its hooks stay outside compiled code;
3. DDP or FSDP wraps the model (training.parallel.wrap);
4. the optimizer comes after the wrapping, since FSDP replaces the parameters by their shards;
5. a CUDA graph captures the whole eager step (forward, backward, clipping, optimizer) after its warm-up steps.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from model import TransformerLM
from model.layers import Linear, SwiGLU
from training import fp8
from training.compilation import compile_regions
from training.config import DTYPES, Config, overlaps_backward
from training.cuda_graph import GraphedStep
from training.optim import OptimizerSettings, get_optimizer
from training.optim.overlapped import OverlappedOptimizer, step_partitions
from training.parallel.activation_checkpointing import checkpoint_blocks
from training.parallel.distributed import DistContext
from training.parallel.wrap import wrap_model
from training.precision import autocast, grad_scaler

GRAPH_WARMUP = 2  # eager steps before a CUDA graph is captured (compile and autotune happen in the first)


def warm_up_steps(config: Config) -> int:
    """The first steps that do one-time work (compile; the graph's eager steps and its capture), which a run times
    apart from the others."""
    if config.execution.cuda_graph:
        return GRAPH_WARMUP + 1
    return int(bool(config.execution.compile))


def keep_weight_copies(model: nn.Module, precision: str) -> dict[nn.Parameter, torch.Tensor]:
    """Under bf16/fp16 autocast, each fp32 Linear weight gets a low-precision copy that the forward reads and the
    optimizer rewrites; {weight: copy}. SwiGLU's w1 and w3 share one tensor, which its fused matmul reads whole."""
    if precision == "fp32":
        return {}
    dtype = DTYPES[precision]
    copies: dict[nn.Parameter, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, SwiGLU) and all(type(w) is Linear for w in (m.w1, m.w2, m.w3)):
            copies.update(m.keep_weight_copies(dtype))
        elif type(m) is Linear and m.weight.dtype == torch.float32 and m.weight not in copies:
            copies[m.weight] = m.keep_weight_copy(dtype)
    return copies


def make_optimizer(model: nn.Module, config: Config, device: torch.device,
                   weight_copies: Optional[dict[nn.Parameter, torch.Tensor]] = None,
                   overlap: bool = False) -> torch.optim.Optimizer | OverlappedOptimizer:
    """The optimizer config.optim names, over `model`'s parameters (FSDP's are shards by now); stepped during the
    backward with `overlap`. Under a CUDA graph the learning rate is a device tensor that set_lr fills in place."""
    spec = get_optimizer(config.optim.optimizer)
    graphed = bool(config.execution.cuda_graph)
    lr = torch.tensor(config.optim.lr, device=device) if graphed else config.optim.lr
    settings = OptimizerSettings(config.optim, lr, device, capturable=graphed, weight_copies=weight_copies)
    if overlap:
        return OverlappedOptimizer(step_partitions(model), lambda params: spec.build(model, params, settings))
    return spec.build(model, [p for p in model.parameters() if p.requires_grad], settings)


def set_lr(optimizer: torch.optim.Optimizer | OverlappedOptimizer, lr: float) -> None:
    """Every group's learning rate (`lr` times the group's "lr_scale", if any); a tensor learning rate (CUDA graphs),
    which the groups of one scale share, is written in place once: a fill per group (one per parameter when the
    optimizer steps in the backward) would be a kernel each."""
    filled: set[int] = set()
    for group in optimizer.param_groups:
        value, target = group["lr"], lr * group.get("lr_scale", 1.0)
        if not isinstance(value, torch.Tensor):
            group["lr"] = target
        elif id(value) not in filled:
            value.fill_(target)
            filled.add(id(value))


@dataclass
class TrainingStep:
    """A built step. `model` owns the parameters under their plain names (checkpoints, optimizer); `step_model` is
    what the forward calls: the model, DDP- or FSDP-wrapped and compiled as asked.

    `step(x, y)` runs a whole step; `loss`, `backward` and `optimizer_step` are its phases, for timing them apart.
    """

    model: nn.Module
    step_model: Callable[..., torch.Tensor]  # (ids, targets[, doc_ids=]) -> mean loss
    optimizer: torch.optim.Optimizer | OverlappedOptimizer
    scaler: torch.amp.GradScaler
    config: Config
    device: torch.device
    grad_norm: bool = True  # return the global gradient norm (bench_model times the step without it)
    graphed: Optional[GraphedStep] = None
    after_update: Optional[Callable[[], None]] = None  # run after each optimizer step (float8 scales under FSDP)

    def loss(self, x: torch.Tensor, y: torch.Tensor, model: Optional[Callable] = None,
             doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy, in fp32, computed inside the model (in its compiled code under compile).
        doc_ids: packed documents' ids (training/data/sampling.py), for the model's document mask."""
        with autocast(self.device, self.config.execution.dtype):
            if doc_ids is None:
                return (model or self.step_model)(x, y)
            return (model or self.step_model)(x, y, doc_ids=doc_ids)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Inside, with sync False: DDP and FSDP keep the gradients local (accumulated micro-batches but the last)."""
        if sync:
            yield
        elif isinstance(self.step_model, nn.parallel.DistributedDataParallel):
            with self.step_model.no_sync():
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
        """The backward (of the scaled loss under fp16); an optimizer overlapped with it steps inside."""
        self.scaler.scale(loss).backward()

    def gradient_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the model holds."""
        return torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def optimizer_step(self) -> Optional[torch.Tensor]:
        """Unscale (fp16), clip, step; returns the global gradient norm when clipping computed it, else None.
        The scaler is a no-op unless fp16, which a CUDA graph refuses: its inf checks read values on the host."""
        self.scaler.unscale_(self.optimizer)
        clip = self.config.optim.grad_clip
        norm = self.gradient_norm() if clip > 0 else None
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0) if clip > 0 else None  # clip_grad_norm_'s coefficient
        self.scaler.step(self.optimizer, clip_coef=coef)
        self.scaler.update()
        if self.after_update is not None:
            self.after_update()
        return norm

    def eager_step(self, x: torch.Tensor, y: torch.Tensor,
                   doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """Forward, backward and optimizer without synchronising or clearing gradients: what a CUDA graph captures.
        Returns (loss,) or (loss, grad norm)."""
        n = self.config.execution.grad_accum_steps
        # Equal micro-batches: the mean of their mean losses is the batch's mean loss, and so are the gradients.
        chunks = zip(x.chunk(n), y.chunk(n), doc_ids.chunk(n) if doc_ids is not None else [None] * n)
        loss = x.new_zeros((), dtype=torch.float32)
        for i, (xi, yi, di) in enumerate(chunks):
            with self.gradient_sync(i == n - 1):
                micro = self.loss(xi, yi, None, di)
                self.backward(micro / n if n > 1 else micro)
            loss = loss + micro.detach() / n
        norm = self.optimizer_step()
        return (loss,) if norm is None else (loss, norm)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                 want_norm: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One whole step, replayed as a CUDA graph when so built; (loss, grad norm or None), gradients cleared.

        Without clipping the step computes no norm; with `want_norm` (and grad_norm) it is computed from the
        gradients after the step, so that steps that log nothing (and a captured graph) do not pay for it."""
        inputs = (x, y) if doc_ids is None else (x, y, doc_ids)
        # A graph keeps its gradients in its pool until the next replay; an eager step's are cleared after it.
        out = self.graphed(*inputs) if self.graphed is not None else self.eager_step(*inputs)
        norm = out[1] if len(out) > 1 else None
        if norm is None and want_norm and self.grad_norm:
            norm = self.gradient_norm()
        if self.graphed is None:
            self.optimizer.zero_grad(set_to_none=True)
        return out[0], norm

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)


def build_step(model: nn.Module, config: Config, ctx: Optional[DistContext] = None, grad_norm: bool = True,
               graph_warmup: int = GRAPH_WARMUP, overlap: Optional[bool] = None) -> TrainingStep:
    """The step for `model` (on its device, the same initial weights on every rank), in the recipe's order.

    `config` is resolved (training.config.resolve): every combination it holds can be built. `ctx`: the process's
    place in a DDP/FSDP group (None: one process). A model other than TransformerLM (the Hugging Face peer of
    bench_model.py) is compiled whole. overlap: whether the optimizer steps during the backward (default: where
    training.config.overlaps_backward allows it; bench_model.py keeps the peer's plain step).
    """
    ctx = ctx or DistContext(device=next(model.parameters()).device)
    ex = config.execution
    float8_all_gather = fp8.gathers_float8(ex.fp8, ex.parallel)
    if ex.fp8 != "off":  # first: checkpointing, compile, FSDP and the optimizer see the new layers
        fp8.convert(model, ex.fp8, ctx.device, float8_all_gather)
    spec = get_optimizer(config.optim.optimizer)
    # Before compiling; not under FSDP, which casts each weight as it all-gathers it.
    copies = keep_weight_copies(model, ex.dtype) if spec.keeps_weight_copies and ex.parallel != "fsdp" else None
    if ex.activation_checkpointing:
        checkpoint_blocks(model, ex.recompute)
    regional = isinstance(model, TransformerLM)
    if ex.compile and regional:
        compile_regions(model)  # after checkpointing (the recomputed forward is compiled), before FSDP
    step_model = wrap_model(model, ctx, DTYPES[ex.dtype])  # `model` keeps the plain names
    if ex.compile and not regional:
        step_model = torch.compile(step_model, dynamic=False)
    overlap = overlaps_backward(config, ctx.world_size) if overlap is None else overlap
    optimizer = make_optimizer(model, config, ctx.device, copies, overlap)
    step = TrainingStep(model, step_model, optimizer, grad_scaler(ctx.device, ex.dtype), config, ctx.device,
                        grad_norm, after_update=functools.partial(fp8.precompute_scales, model)
                        if float8_all_gather else None)
    if ex.cuda_graph:
        step.graphed = GraphedStep(step.eager_step, optimizer, warmup=graph_warmup)
    return step
