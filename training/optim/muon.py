"""`muon`: Muon for the blocks' hidden matrices, AdamW for the rest (embedding, LM head, norm gains), as one optimizer.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/) replaces a matrix's update by its orthogonalised
momentum: a few Newton-Schulz iterations push the singular values of the momentum towards 1, so that the update
moves every direction of the matrix by about as much. It is meant for hidden matrices: the embedding is a lookup
table, the LM head's rows are per-token logits and the norm gains are vectors, and AdamW keeps those.

The hidden matrices are torch.optim.Muon's (PyTorch >= 2.9), with:
- adjust_lr_fn="match_rms_adamw": each update is scaled by 0.2 * sqrt(max(rows, cols)), so that its RMS is about
  AdamW's (0.2) and the run's --lr and --weight-decay serve both parts (Moonshot AI, "Muon is Scalable for LLM
  Training", https://arxiv.org/abs/2502.16982, section 2.2: AdamW's learning rate and weight decay, reused);
- momentum 0.95 with Nesterov, and 5 Newton-Schulz steps of the quintic (3.4445, -4.7750, 2.0315): the defaults of
  Keller Jordan's Muon and of modded-nanogpt's speedruns (https://github.com/KellerJordan/modded-nanogpt), which
  torch.optim.Muon also takes.
The rest is training/optim/adamw.py's AdamW (fused on CUDA) with the run's --lr and --weight-decay.

This model's q, k and v projections are one matrix (model/transformer.py): Muon orthogonalises it whole, where
modded-nanogpt orthogonalises q, k and v apart. What it cannot run with, declared to the registry: a CUDA graph
(torch.optim.Muon reads its learning rate on the host, `_to_scalar`), FSDP's shards (Newton-Schulz needs whole
matrices), and a step during the backward (the overlap hides memory-bound updates; Newton-Schulz is matmuls). Under
DDP every rank computes the same update from the all-reduced gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from training.optim.adamw import AdamW
from training.optim.registry import BETAS, EPS, OptimizerSettings, decay_groups, register

MOMENTUM = 0.95
NESTEROV = True
NS_STEPS = 5
ADJUST_LR = "match_rms_adamw"


def hidden_matrices(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`params` split into the blocks' 2-D weights (q/k/v, out, w1, w2, w3) and the rest, each in model order."""
    in_blocks = {id(p) for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2}
    return [p for p in params if id(p) in in_blocks], [p for p in params if id(p) not in in_blocks]


class MuonAdamW:
    """torch.optim.Muon over the hidden matrices and AdamW over the rest, driven as one optimizer: `step(clip_coef=)`,
    `param_groups`, `zero_grad`, `state_dict`/`load_state_dict`; `.optimizers` lists the two (checkpoints save and
    load their states by parameter name through that list: training/checkpoint/resume.py)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.optimizers: list[torch.optim.Optimizer] = [muon, adamw]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Both optimizers' groups (the dicts themselves: set_lr sets each part's learning rate)."""
        return [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, clip_coef: Optional[torch.Tensor] = None) -> None:
        """Scale every gradient by `clip_coef` (one foreach kernel for both parts), then step Muon and AdamW."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure: the training step computes the loss")
        if clip_coef is not None:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon_adamw": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state.get("muon_adamw")
        if parts is None or len(parts) != len(self.optimizers):
            raise ValueError("this optimizer state is not a MuonAdamW's (Muon's, then AdamW's)")
        for opt, part in zip(self.optimizers, parts):
            opt.load_state_dict(part)


@register("muon", description="Muon (torch.optim.Muon, Moonshot's AdamW-matched update RMS) for the blocks' "
                              "matrices, AdamW for the embedding, LM head and norm gains",
          shards=False, capturable=False)
def build(model: nn.Module, params: list[nn.Parameter], s: OptimizerSettings) -> MuonAdamW:
    from training.config import ConfigError

    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"--optimizer muon needs torch.optim.Muon (PyTorch >= 2.9); this is {torch.__version__}")
    matrices, rest = hidden_matrices(model, params)
    if not matrices:
        raise ConfigError(f"--optimizer muon optimizes the matrices of the model's blocks; {type(model).__name__} "
                          "has no 2-D parameter under `blocks.`")
    if isinstance(s.lr, torch.Tensor):  # resolve() never graphs this optimizer (capturable=False)
        raise ConfigError("--optimizer muon reads its learning rate on the host: drop --cuda-graph")
    wd = s.config.weight_decay
    muon = torch.optim.Muon(matrices, lr=s.lr, weight_decay=wd, momentum=MOMENTUM, nesterov=NESTEROV,
                            ns_steps=NS_STEPS, adjust_lr_fn=ADJUST_LR)
    adamw = AdamW(decay_groups(rest, wd), lr=s.lr, betas=BETAS, eps=EPS, fused=s.device.type == "cuda")
    return MuonAdamW(muon, adamw)
