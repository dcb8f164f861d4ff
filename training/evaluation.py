"""Evaluation of a model on held-out tokens: mean loss, perplexity and bits per byte.

Bits per byte compare models whatever their tokenizer: the summed loss (nats) over the evaluated tokens divided by
ln 2 and by the bytes of text those tokens encode, loss_nats * tokens / (ln 2 * bytes). `token_bytes[id]` gives
the bytes each token id stands for (training/data/tokenizer.py); for byte-level data every token is one byte and the
bits per byte are loss / ln 2 exactly. The trainer's val_loss / val_bpb and evaluate.py score the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from training.data.sampling import Batch
from training.parallel import distributed
from training.parallel.distributed import DistContext

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean next-token cross-entropy, nats
    bytes_per_token: Optional[float]  # None when the data does not say which text its tokens encode
    tokens: int  # targets scored (all ranks together)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bpb(self) -> Optional[float]:
        """Bits per byte: loss * tokens / (ln 2 * bytes)."""
        return None if self.bytes_per_token is None else self.loss / (math.log(2) * self.bytes_per_token)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        out = {f"{prefix}_loss": self.loss}
        if self.bpb is not None:
            out[f"{prefix}_bpb"] = self.bpb
        return out


@torch.no_grad()
def evaluate(loss_fn: LossFn, batches: Iterable[Batch], token_bytes: Optional[torch.Tensor] = None,
             ctx: DistContext = DistContext()) -> Evaluation:
    """Score `batches` with `loss_fn(inputs, targets)` (a mean loss per batch); weighted by each batch's tokens.

    Under DDP/FSDP each rank scores its equal share of every batch and the figures are averaged over the ranks.
    `token_bytes` (on the batches' device): the bytes each token id stands for, or None (no bits per byte).
    """
    losses, counts, n_bytes = [], [], []
    for batch in batches:
        x, y = batch.inputs, batch.targets
        losses.append(loss_fn(x, y).float())
        counts.append(y.numel())
        if token_bytes is not None:
            n_bytes.append(token_bytes[y].sum())
    if not losses:
        raise ValueError("nothing to evaluate: no batches")
    weights = torch.tensor(counts, dtype=torch.float32, device=losses[0].device)
    n_tokens = sum(counts)
    loss = distributed.mean_over_ranks((torch.stack(losses) * weights).sum() / n_tokens, ctx)
    per_token = None
    if token_bytes is not None:
        per_token = distributed.mean_over_ranks(torch.stack(n_bytes).sum().double() / n_tokens, ctx)
    return Evaluation(loss, per_token, n_tokens * ctx.world_size)
