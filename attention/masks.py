"""The attention variants as materialised boolean masks, for the backends that take one (naive, sdpa).

The semantics are the registry's (attention/registry.py): causal, a sliding window, documents. flash and flex never
build these: flash skips tiles from per-position document bounds, flex evaluates the same rule as a mask_mod.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def visible_mask(n_q: int, n_k: int, causal: bool, window: Optional[int], doc_ids: Optional[torch.Tensor],
                 device: torch.device) -> Optional[torch.Tensor]:
    """True where query i sees key j: doc_ids.shape[:-1] + (n_q, n_k), or (n_q, n_k) without documents.

    None when every query sees every key (no causal mask, window or documents). Callers add the head dims.
    """
    if not causal and window is None and doc_ids is None:
        return None
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= (rows - cols < window) if causal else ((rows - cols).abs() < window)
    if doc_ids is not None:
        mask = mask & (doc_ids[..., :, None] == doc_ids[..., None, :])
    return mask


def mask_elements(n_q: int, n_k: int, doc_ids: Optional[torch.Tensor], lead: tuple[int, ...] = ()) -> int:
    """How many elements the mask of a call holds once materialised (its size in bytes, as bool): visible_mask's,
    with documents one (n_q, n_k) mask per sequence of q's leading dims `lead` (doc_ids broadcast to them)."""
    if doc_ids is None:
        return n_q * n_k
    return math.prod(torch.broadcast_shapes(tuple(doc_ids.shape[:-1]), lead)) * n_q * n_k


def doc_bounds(doc_ids: torch.Tensor, lead: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end), int32 (batch, n) with batch = prod(lead): the positions [start[i], end[i]) of i's document.

    doc_ids (broadcastable to lead + (n,), non-decreasing) names each position's document; start and end are where
    that run of equal ids begins and ends. Position i sees j only if start[i] == start[j]; a kernel that knows the
    bounds of a tile's first and last rows skips every key tile outside them.
    """
    ids = doc_ids.expand(*lead, n).reshape(-1, n).contiguous()
    start = torch.searchsorted(ids, ids, side="left", out_int32=True)
    end = torch.searchsorted(ids, ids, side="right", out_int32=True)
    return start, end
