"""A whole training step (forward, backward, clipping, optimizer) replayed as one CUDA graph.

With static shapes every step launches the same kernels, so they can be recorded once and replayed with a single
launch: the host's Python, autograd and launch time per step (the cost of short or narrow steps, and of any
backend launched from Python, such as the Triton kernels of `flash`) disappears. The recipe is PyTorch's
whole-network capture (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):
- The first `warmup` calls run eagerly on a side stream: they are real steps on their own batches, and they do the
  one-time work that must not be captured (torch.compile, Triton autotuning, cuBLAS workspaces, optimizer state).
- The next call captures the step with the gradients unset, so the captured backward writes fresh gradients; each
  later call copies its batch into the static inputs and replays.
- Warm-up and capture run inside `attention.graph_replay()`: attention backends may pick the kernels with the least
  GPU time even where their launches cost more host time, which is paid once here (flash's Hopper kernels on short
  sequences), and compiled code traced in the warm-up keeps that choice.
Requirements, checked where they can be: a CUDA device; fixed input shapes and dtypes; an optimizer built with
`capturable=True` (its step count lives on the GPU) and, if the learning rate changes, a tensor learning rate
updated in place (`group["lr"].fill_(lr)`); nothing in the step that synchronises with the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from attention import graph_replay


class GraphedStep:
    """`GraphedStep(step_fn, optimizer)(*inputs)` runs `step_fn(*inputs)` (which must return tensors), captured.

    step_fn does forward, backward and optimizer.step(); the gradients are set to None before each eager step and
    before capture (not inside step_fn). The returned tensors are the graph's static outputs: read them before the
    next call, which overwrites them.
    """

    def __init__(self, step_fn: Callable[..., tuple[torch.Tensor, ...]], optimizer: torch.optim.Optimizer,
                 warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (compile and autotune before capture), got {warmup}")
        for group in optimizer.param_groups:
            if not group.get("capturable", False):
                raise ValueError("a CUDA-graphed step needs an optimizer built with capturable=True "
                                 "(its step count must live on the GPU, not be baked into the graph)")
        self.step_fn, self.optimizer, self.warmup = step_fn, optimizer, warmup
        self.calls = 0
        self.graph = None
        self.static_inputs: tuple[torch.Tensor, ...] = ()
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self._side = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for t in inputs:
            if not t.is_cuda:
                raise ValueError(f"a CUDA-graphed step needs CUDA tensors, got one on {t.device}")
        self.calls += 1
        if self.graph is not None:
            self._check_like_static(inputs)
            for static, t in zip(self.static_inputs, inputs):
                static.copy_(t)
            self.graph.replay()
            return self.static_outputs
        with graph_replay():
            if self.calls <= self.warmup:
                return self._eager(inputs)
            return self._capture(inputs)

    def _eager(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # On a side stream, as the capture will be: lazy per-stream state is then initialised before capture.
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            self.optimizer.zero_grad(set_to_none=True)
            out = tuple(self.step_fn(*inputs))
        torch.cuda.current_stream().wait_stream(self._side)
        return out

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        torch.cuda.synchronize()
        # With the inputs' strides, not clone()'s contiguous ones: compiled code guards on strides, and a batch
        # sliced from a longer window (stride seq + 1) would otherwise recompile inside the capture, which fails.
        self.static_inputs = tuple(
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t) for t in inputs)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_outputs = tuple(self.step_fn(*self.static_inputs))
        self.graph = graph
        graph.replay()  # capture only records: this call's step runs now
        return self.static_outputs

    def _check_like_static(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"the step was captured with {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (static, t) in enumerate(zip(self.static_inputs, inputs)):
            if t.shape != static.shape or t.dtype != static.dtype or t.device != static.device:
                raise ValueError(
                    f"input {i} is {tuple(t.shape)} {t.dtype} on {t.device}, but the step was captured with "
                    f"{tuple(static.shape)} {static.dtype} on {static.device}: a CUDA graph replays fixed shapes")
