"""Evaluation of a model on held-out tokens: mean loss, perplexity and bits per byte.

Bits per byte compare models whatever their tokenizer: the summed loss (nats) over the evaluated tokens divided by
ln 2 and by the bytes of text those tokens encode, loss_nats * tokens / (ln 2 * bytes). `token_bytes[id]` gives
the bytes each token id stands for (training.tokenizer); for byte-level data every token is one byte and the bits
per byte are loss / ln 2 exactly.

train.py calls `evaluate` for val_loss / val_bpb, and evaluate.py for a checkpoint, on the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from training import distributed
from training.data import batch_at
from training.distributed import DistContext

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
def evaluate(loss_fn: LossFn, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             token_bytes: Optional[torch.Tensor] = None, ctx: DistContext = DistContext()) -> Evaluation:
    """Score `batches` of (inputs, targets) with `loss_fn` (a mean loss per batch); weighted by each batch's tokens.

    Under DDP/FSDP each rank scores its equal share of every batch and the figures are averaged over the ranks.
    `token_bytes` (on the batches' device): the bytes each token id stands for, or None (no bits per byte).
    """
    losses, counts, n_bytes = [], [], []
    for x, y in batches:
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


def sampled_batches(tokens: np.ndarray, batch_size: int, context_length: int, n_batches: int, seed: int,
                    ctx: DistContext = DistContext()) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation batches of a run: drawn by (seed, index), not by training step, so that every
    evaluation of the run sees the same data."""
    for i in range(n_batches):
        yield batch_at(tokens, batch_size, context_length, seed, i, rank=ctx.rank, world_size=ctx.world_size,
                       device=ctx.device)


def sequential_batches(tokens: np.ndarray, batch_size: int, context_length: int,
                       device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every token of `tokens` once as a target (but the first): consecutive windows, the last one shorter."""
    n = len(tokens) - 1
    starts = list(range(0, n, context_length))
    for i in range(0, len(starts), batch_size):
        rows = starts[i:i + batch_size]
        full = [s for s in rows if s + context_length <= n]
        if full:
            w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in full]))
            w = w.to(device)
            yield w[:, :-1], w[:, 1:]
        for s in rows[len(full):]:  # the tail window, shorter than the context
            w = torch.from_numpy(np.asarray(tokens[s:n + 1], dtype=np.int64))[None].to(device)
            yield w[:, :-1], w[:, 1:]
