"""`flash-torch`: FlashAttention-2 written tile by tile in plain PyTorch (`FlashAttentionTorch`).

The readable specification of the algorithm the Triton kernels of attention/flash/triton_kernels.py implement;
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
"""

from __future__ import annotations

from typing import Optional

import torch

from attention.flash.common import attention_function, default_scale, empty
from attention.registry import register, validate_qkv

Q_TILE = 64  # query rows per tile
K_TILE = 64  # key rows per tile


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_mask(q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[torch.Tensor]:
    """True where key > query inside the tile (q0:q1, k0:k1), or None when the tile is wholly visible."""
    if k1 - 1 <= q0:  # the tile's last key is at or before its first query
        return None
    rows = torch.arange(q0, q1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    return cols > rows


def flash_forward_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o like q, lse (..., seq_q) in the accumulator dtype (natural log)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc_dtype = _acc_dtype(q.dtype)
    o = empty(q.shape, q.dtype, q.device)
    lse = empty(q.shape[:-1], acc_dtype, q.device)
    for q0 in range(0, n_q, Q_TILE):
        q1 = min(q0 + Q_TILE, n_q)
        q_i = q[..., q0:q1, :].to(acc_dtype)  # (..., tq, d)
        m = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (..., tq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_i)  # (..., tq, d)
        # Causal: query q1 - 1 is the last row of the tile; keys after it are never visible.
        k_end = min(q1, n_k) if causal else n_k
        for k0 in range(0, k_end, K_TILE):
            k1 = min(k0 + K_TILE, k_end)
            s = q_i @ k[..., k0:k1, :].to(acc_dtype).transpose(-2, -1) * scale  # (..., tq, tk)
            if causal and (mask := _causal_mask(q0, q1, k0, k1, q.device)) is not None:
                s = s.masked_fill(mask, float("-inf"))
            # Every row saw key 0 in its first tile, so m_new is finite and exp(m - m_new) is well defined.
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v[..., k0:k1, :].to(acc_dtype)
            m = m_new
        o[..., q0:q1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., q0:q1] = m + torch.log(l)
    return o, lse


def flash_backward_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by recomputing P from lse, one key tile (outer) and query tile (inner) at a time.

    Here dQ accumulates inside the same double loop; the Triton kernel instead runs a second pass with
    the loops swapped, so that no two programs add into the same dQ rows (no atomics).
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc_dtype = _acc_dtype(q.dtype)
    delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(dim=-1)  # (..., n_q)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    for k0 in range(0, n_k, K_TILE):
        k1 = min(k0 + K_TILE, n_k)
        k_j = k[..., k0:k1, :].to(acc_dtype)
        v_j = v[..., k0:k1, :].to(acc_dtype)
        dk_j = torch.zeros_like(k_j)
        dv_j = torch.zeros_like(v_j)
        # Causal: queries before k0 see none of these keys; start at the query tile holding row k0.
        q_start = (k0 // Q_TILE) * Q_TILE if causal else 0
        for q0 in range(q_start, n_q, Q_TILE):
            q1 = min(q0 + Q_TILE, n_q)
            q_i = q[..., q0:q1, :].to(acc_dtype)
            do_i = do[..., q0:q1, :].to(acc_dtype)
            s = q_i @ k_j.transpose(-2, -1) * scale  # (..., tq, tk)
            p = torch.exp(s - lse[..., q0:q1, None].to(acc_dtype))
            if causal and (mask := _causal_mask(q0, q1, k0, k1, q.device)) is not None:
                p = p.masked_fill(mask, 0.0)
            dv_j += p.transpose(-2, -1) @ do_i
            dp = do_i @ v_j.transpose(-2, -1)
            ds = p * (dp - delta[..., q0:q1, None])
            dq[..., q0:q1, :] += scale * (ds @ k_j)
            dk_j += scale * (ds.transpose(-2, -1) @ q_i)
        dk[..., k0:k1, :] = dk_j.to(k.dtype)
        dv[..., k0:k1, :] = dv_j.to(v.dtype)
    return dq.to(q.dtype), dk, dv


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float]) -> float:
    validate_qkv(q, k, v, causal)
    return default_scale(q, scale)


FlashAttentionTorch = attention_function(
    "FlashAttentionTorch", "`FlashAttentionTorch.apply(q, k, v, is_causal=False, scale=None)` on (..., seq, d_head).",
    _check, flash_forward_torch, flash_backward_torch)


@register("flash-torch", description="FlashAttention-2 tile by tile in PyTorch: the readable spec of `flash`; slow")
def flash_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    return FlashAttentionTorch.apply(q, k, v, causal, scale)
