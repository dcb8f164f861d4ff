"""`flash-torch`: FlashAttention-2 written tile by tile in plain PyTorch (`FlashAttentionTorch`).

The readable specification of the algorithm the Triton kernels of attention/flash/triton/kernels.py implement;
read this first. It never materialises the (seq_q, seq_k) score matrix: memory beyond the inputs and outputs is
one (Q_TILE, K_TILE) tile at a time. It is slow (Python loops over tiles) but runs on any device and
dtype, CPU included.

Forward, for each query tile i and each key tile j it can see:
    S_ij = scale * Q_i K_j^T
    m_new = max(m, rowmax(S_ij))                  running row max
    P_ij = exp(S_ij - m_new)
    l = l * exp(m - m_new) + rowsum(P_ij)         running row sum, rescaled to the new max
    acc = acc * exp(m - m_new) + P_ij V_j         unnormalised output, rescaled likewise
  then O_i = acc / l and L_i = m + log(l), the row log-sum-exp: the only thing saved beyond q, k, v, o.
Backward, recomputing P from L instead of storing it:
    P_ij = exp(S_ij - L_i);  dV_j += P_ij^T dO_i;  dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - delta_i)   with delta = rowsum(dO * O)  (== rowsum(P * dP), cheaper)
    dQ_i += scale * dS_ij K_j;  dK_j += scale * dS_ij^T Q_i
Causal: key tiles entirely right of the diagonal are skipped; only tiles touching it are masked.
Variants (attention/registry.py): a window or documents narrow the key tiles a query tile visits in the same way
(_key_range, _query_range); softcap replaces S by c * tanh(S / c) and multiplies dS by its derivative 1 - tanh^2;
GQA views q as (batch, h_kv, group, seq, d) against k, v as (batch, h_kv, 1, seq, d) and sums dK, dV over the group.
"""

from __future__ import annotations

from typing import Optional

import torch

from attention.flash.common import as_bhsd, default_scale, empty
from attention.masks import doc_bounds
from attention.registry import VARIANTS, kv_groups, register, validate_qkv, validate_variant

Q_TILE = 64  # query rows per tile
K_TILE = 64  # key rows per tile

Bounds = Optional[tuple[torch.Tensor, torch.Tensor]]  # (start, end) of each position's document, (batch, seq)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_mask(q0: int, q1: int, k0: int, k1: int, causal: bool, window: Optional[int], docs: Bounds,
               device: torch.device) -> Optional[torch.Tensor]:
    """True where query i sees key j in the tile (q0:q1, k0:k1): (tq, tk), or (batch, 1, 1, tq, tk) with documents.
    None when every query of the tile sees every key of it."""
    rows = torch.arange(q0, q1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= (rows - cols < window) if causal else ((rows - cols).abs() < window)
    if docs is not None:
        start = docs[0]
        mask = mask & (start[:, q0:q1, None] == start[:, None, k0:k1])[:, None, None]
    return None if bool(mask.all()) else mask


def _key_range(q0: int, q1: int, n_k: int, causal: bool, window: Optional[int], docs: Bounds) -> tuple[int, int]:
    """[lo, hi): the keys some query of rows q0:q1 sees; the tiles outside are skipped."""
    lo, hi = 0, min(q1, n_k) if causal else n_k
    if window is not None:
        lo = max(lo, q0 - window + 1)
        if not causal:
            hi = min(hi, q1 - 1 + window)
    if docs is not None:  # documents are runs of positions: rows q0:q1 see keys from q0's run to (q1 - 1)'s
        lo = max(lo, int(docs[0][:, q0].min()))
        hi = min(hi, int(docs[1][:, q1 - 1].max()))
    return lo, hi


def _query_range(k0: int, k1: int, n_q: int, causal: bool, window: Optional[int], docs: Bounds) -> tuple[int, int]:
    """[lo, hi): the queries that see some key of k0:k1."""
    lo, hi = (k0 if causal else 0), n_q
    if window is not None:
        hi = min(hi, k1 - 1 + window)
        if not causal:
            lo = max(lo, k0 - window + 1)
    if docs is not None:
        lo = max(lo, int(docs[0][:, k0].min()))
        hi = min(hi, int(docs[1][:, k1 - 1].max()))
    return lo, hi


def _views(q: torch.Tensor, k: torch.Tensor, doc_ids: Optional[torch.Tensor]):
    """q as (batch, h_kv, group, seq, d), a function doing the same to k-shaped tensors ((batch, h_kv, 1, seq, d)),
    and the document bounds."""
    groups = kv_groups(q, k)
    q5 = as_bhsd(q).unflatten(1, (-1, groups))
    docs = None if doc_ids is None else doc_bounds(doc_ids, tuple(q.shape[:-3]), q.shape[-2])
    return q5, (lambda t: as_bhsd(t)[:, :, None]), docs


def _scores(q_i: torch.Tensor, k_j: torch.Tensor, scale: float, softcap: Optional[float]):
    """(S, tanh) of one tile: S = scale q k^T, soft-capped to c * tanh(S / c) (and tanh kept for the backward)."""
    s = q_i @ k_j.transpose(-2, -1) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def flash_forward_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
    softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q, lse (..., seq_q) in the accumulator dtype (natural log)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc_dtype = _acc_dtype(q.dtype)
    q5, kv_view, docs = _views(q, k, doc_ids)
    k5, v5 = kv_view(k), kv_view(v)
    o5 = empty(q5.shape, q.dtype, q.device)
    lse5 = empty(q5.shape[:-1], acc_dtype, q.device)
    for q0 in range(0, n_q, Q_TILE):
        q1 = min(q0 + Q_TILE, n_q)
        q_i = q5[..., q0:q1, :].to(acc_dtype)  # (b, h_kv, group, tq, d)
        m = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (..., tq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_i)  # (..., tq, d)
        lo, hi = _key_range(q0, q1, n_k, causal, window, docs)
        for k0 in range((lo // K_TILE) * K_TILE, hi, K_TILE):
            k1 = min(k0 + K_TILE, hi)
            s, _ = _scores(q_i, k5[..., k0:k1, :].to(acc_dtype), scale, softcap)  # (..., tq, tk)
            if (mask := _tile_mask(q0, q1, k0, k1, causal, window, docs, q.device)) is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen no key yet (a window or document starting inside this tile) keeps m = -inf: shift
            # by 0 there, so its exp() are 0 instead of NaN. Every row sees some key by the end (the registry's
            # checks), so l > 0 below.
            shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v5[..., k0:k1, :].to(acc_dtype)
            m = m_new
        o5[..., q0:q1, :] = (acc / l[..., None]).to(q.dtype)
        lse5[..., q0:q1] = m + torch.log(l)
    return o5.reshape(q.shape), lse5.reshape(q.shape[:-1])


def flash_backward_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    causal: bool, scale: float, window: Optional[int] = None, softcap: Optional[float] = None,
    doc_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by recomputing P from lse, one key tile (outer) and query tile (inner) at a time.

    Here dQ accumulates inside the same double loop; the Triton kernel instead runs a second pass with
    the loops swapped, so that no two programs add into the same dQ rows (no atomics).
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc_dtype = _acc_dtype(q.dtype)
    q5, kv_view, docs = _views(q, k, doc_ids)
    k5, v5 = kv_view(k), kv_view(v)
    do5 = as_bhsd(do).reshape(q5.shape)
    lse5 = lse.reshape(q5.shape[:-1])
    delta = (do5.to(acc_dtype) * as_bhsd(o).reshape(q5.shape).to(acc_dtype)).sum(dim=-1)  # (..., n_q)
    dq5 = torch.zeros(q5.shape, dtype=acc_dtype, device=q.device)
    dk5 = empty(k5.shape, k.dtype, k.device)
    dv5 = empty(v5.shape, v.dtype, v.device)
    for k0 in range(0, n_k, K_TILE):
        k1 = min(k0 + K_TILE, n_k)
        k_j = k5[..., k0:k1, :].to(acc_dtype)
        v_j = v5[..., k0:k1, :].to(acc_dtype)
        dk_j = torch.zeros_like(k_j)
        dv_j = torch.zeros_like(v_j)
        lo, hi = _query_range(k0, k1, n_q, causal, window, docs)
        for q0 in range((lo // Q_TILE) * Q_TILE, hi, Q_TILE):
            q1 = min(q0 + Q_TILE, n_q)
            q_i = q5[..., q0:q1, :].to(acc_dtype)
            do_i = do5[..., q0:q1, :].to(acc_dtype)
            s, tanh = _scores(q_i, k_j, scale, softcap)  # (..., tq, tk)
            p = torch.exp(s - lse5[..., q0:q1, None].to(acc_dtype))
            if (mask := _tile_mask(q0, q1, k0, k1, causal, window, docs, q.device)) is not None:
                p = p.masked_fill(~mask, 0.0)
            dv_j += (p.transpose(-2, -1) @ do_i).sum(dim=2, keepdim=True)  # over the group's query heads
            dp = do_i @ v_j.transpose(-2, -1)
            ds = p * (dp - delta[..., q0:q1, None])
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)  # d(c tanh(S / c)) / dS
            dq5[..., q0:q1, :] += scale * (ds @ k_j)
            dk_j += scale * (ds.transpose(-2, -1) @ q_i).sum(dim=2, keepdim=True)
        dk5[..., k0:k1, :] = dk_j.to(k.dtype)
        dv5[..., k0:k1, :] = dv_j.to(v.dtype)
    return dq5.to(q.dtype).reshape(q.shape), dk5.reshape(k.shape), dv5.reshape(v.shape)


class _FlashTorch(torch.autograd.Function):
    """flash_forward_torch and flash_backward_torch on inputs the registry validated: what `flash-torch` runs. It
    saves q, k, v, O and L, the only saved tensor shaped q.shape[:-1]; doc_ids too, so that autograd refuses a
    backward after an in-place change."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window=None, softcap=None, doc_ids=None):
        o, lse = flash_forward_torch(q, k, v, causal, scale, window, softcap, doc_ids)
        ctx.save_for_backward(q, k, v, o, lse, *(() if doc_ids is None else (doc_ids,)))
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, window, softcap
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *doc_ids = ctx.saved_tensors
        dq, dk, dv = flash_backward_torch(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.window, ctx.softcap,
                                          doc_ids[0] if doc_ids else None)
        return dq, dk, dv, None, None, None, None, None


class FlashAttentionTorch(_FlashTorch):
    """`FlashAttentionTorch.apply(q, k, v, is_causal=False, scale=None, window=None, softcap=None, doc_ids=None)` on
    (..., seq, d_head), checking its inputs as the registry does (the CS336 assignment's class)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, window=None, softcap=None, doc_ids=None):
        causal = bool(is_causal)
        validate_qkv(q, k, v, causal, allow_gqa=True)
        validate_variant(q, k, causal, window, softcap, doc_ids)
        return _FlashTorch.forward(ctx, q, k, v, causal, default_scale(q, scale), window, softcap, doc_ids)


@register("flash-torch", description="FlashAttention-2 tile by tile in PyTorch: the readable spec of `flash`; slow",
          variants=tuple(VARIANTS))
def flash_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: Optional[int] = None,
    softcap: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _FlashTorch.apply(q, k, v, causal, scale, window, softcap, doc_ids)
