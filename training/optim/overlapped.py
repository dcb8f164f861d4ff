"""An optimizer stepped during the backward, on a second CUDA stream, each parameter as soon as its gradient is final.

Run after the backward, the memory-bound optimizer adds its whole time to the step. But a parameter's gradient is
final once autograd has accumulated it, and nothing later in the backward reads that parameter. So, as in PyTorch's
optimizer-in-backward recipe (`Tensor.register_post_accumulate_grad_hook`), each partition (a parameter of its own,
`step_partitions`) gets its own optimizer and steps as soon as its gradient is accumulated, on a side stream that
shares the GPU with the rest of the backward; `step()` makes the caller's stream wait for it and steps whatever has
not stepped. Each parameter gets the same update as from one optimizer over all of them, bitwise
(tests/training/optim/test_overlapped.py). It refuses what needs every gradient first: clipping by the global norm,
fp16's loss scale, accumulation over several backward passes; and DDP and FSDP, which reduce gradients after its hooks.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn


def step_partitions(model: nn.Module) -> list[list[nn.Parameter]]:
    """The model's trainable parameters, each in a partition of its own: it steps as soon as its gradient is
    accumulated (a partition per parameter hides more of the optimizer than one per block)."""
    return [[p] for p in model.parameters() if p.requires_grad]


def _on_grad(optimizer: weakref.ref, i: int, param: nn.Parameter) -> None:
    target = optimizer()
    if target is not None:
        target._on_grad(i, param)


class OverlappedOptimizer:
    """`OverlappedOptimizer(partitions, make_optimizer)`: make_optimizer(params) builds each partition's optimizer
    (e.g. torch.optim.AdamW with the run's hyperparameters); use it as an optimizer: backward, then step()."""

    def __init__(self, partitions: Iterable[Sequence[nn.Parameter]],
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.partitions = [list(part) for part in partitions]
        seen: set[int] = set()
        for part in self.partitions:
            if not part:
                raise ValueError("a partition holds no parameters")
            for p in part:
                if not p.requires_grad:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} does not require grad: it would never "
                                     "have a gradient to step on")
                if id(p) in seen:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two partitions (tied weights?)")
                seen.add(id(p))
        self.optimizers = [make_optimizer(part) for part in self.partitions]
        self._waiting = [len(part) for part in self.partitions]  # gradients still to come, this backward
        self._stepped = [False] * len(self.partitions)
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        # The hooks reach the optimizer through a weak reference: a parameter holding it strongly would make a cycle
        # (parameter -> hook -> optimizer -> parameter) that keeps a dropped optimizer, its state and the model alive
        # until the garbage collector runs (seen as 15-30 GiB more peak memory in the next bench_model row).
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, weakref.ref(self), i))
                       for i, part in enumerate(self.partitions) for p in part]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every partition's groups (the dicts themselves: setting a group's lr sets that partition's)."""
        return [group for opt in self.optimizers for group in opt.param_groups]

    def _on_grad(self, i: int, param: nn.Parameter) -> None:
        if self._stepped[i]:
            raise RuntimeError("a second backward before step(): OverlappedOptimizer steps each partition once per "
                               "backward, so it cannot accumulate gradients over several; call step() after each "
                               "backward, or use a plain optimizer")
        self._waiting[i] -= 1
        if self._waiting[i] == 0:
            self._step_partition(i)

    def _step_partition(self, i: int) -> None:
        self._stepped[i] = True
        device = self.partitions[i][0].device
        if device.type != "cuda":
            self._step_now(i)
            return
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        # The autograd engine runs this hook on the stream its backward used: the side stream starts after the
        # gradients just accumulated there, and later backward work on that stream goes on beside the step.
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._step_now(i)

    def _step_now(self, i: int) -> None:
        self.optimizers[i].step()

    def step(self, clip_coef: Optional[torch.Tensor] = None) -> None:
        """Finish the step: wait for the partitions stepped during the backward, step the rest (a partition some of
        whose parameters got no gradient steps here, skipping those parameters, as AdamW does)."""
        if clip_coef is not None:
            raise ValueError("an optimizer stepped during the backward cannot clip: its steps precede the norm")
        for device, side in self._side.items():
            torch.cuda.current_stream(device).wait_stream(side)
        for i, stepped in enumerate(self._stepped):
            if not stepped:
                self._step_now(i)
        self._waiting = [len(part) for part in self.partitions]
        self._stepped = [False] * len(self.partitions)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"overlapped_partitions": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state.get("overlapped_partitions")
        if parts is None:
            raise ValueError("this optimizer state is a single optimizer's, not an OverlappedOptimizer's")
        if len(parts) != len(self.optimizers):
            raise ValueError(f"the optimizer state has {len(parts)} partitions, this model {len(self.optimizers)}")
        for opt, part in zip(self.optimizers, parts):
            opt.load_state_dict(part)

    def remove_hooks(self) -> None:
        """Detach from the parameters (their gradients no longer trigger steps)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
