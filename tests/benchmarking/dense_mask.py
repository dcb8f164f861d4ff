"""The attention mask written out in full, from the definitions in attention/registry.py: what the tests check the
benchmark's O(seq) counts and sampled-row reference against."""

from typing import Optional

import torch


def dense_visible(n: int, causal: bool, window: Optional[int], doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """True where query i sees key j: (n, n), or (batch, n, n) with doc_ids (batch, n)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = torch.ones(n, n, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= (i - j < window) if causal else ((i - j).abs() < window)
    if doc_ids is not None:
        seen = seen & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return seen
