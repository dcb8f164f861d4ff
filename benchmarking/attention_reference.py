"""Float64 reference for attention outputs and gradients on sampled rows, and errors against it.

The reference never builds the full (seq x seq) matrix: it takes the checked (batch, head) slices and,
within them, the checked query rows only (rows x seq scores, float64). Because the correctness pass's
upstream gradient is zero outside those rows, that is enough for exact dq (all rows: zero elsewhere),
dk and dv of the checked slices. So it works where naive itself would run out of memory.
The variants follow their definitions in attention/registry.py: GQA reads each query head's key/value head (dk and
dv of a key/value head sum over its checked query heads), softcap bends the scores, windows and documents mask them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from benchmarking.attention_point import AttentionInputs

# Max error relative to the reference's largest magnitude, per input dtype, above which a row is "FAIL".
# fp32 allows TF32 matmuls (Triton's tl.dot default on GPU); half types allow their rounding of P and O.
RELATIVE_TOLERANCE: dict[str, float] = {"fp32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


@dataclass
class Reference:
    """Reference values for the checked slices: out on checked rows, full dq/dk/dv, all (slices, ...)."""

    out_rows: torch.Tensor  # (slices, rows, d_head) float64
    dq: torch.Tensor  # (slices, seq, d_head)
    dk: torch.Tensor  # (kv slices, seq, d_head): the distinct key/value slices the checked query heads read
    dv: torch.Tensor


def _distinct(slices: list[int]) -> tuple[list[int], list[int]]:
    """(the distinct values in order, each element's index among them)."""
    unique = list(dict.fromkeys(slices))
    return unique, [unique.index(s) for s in slices]


def reference(inputs: AttentionInputs, causal: bool, scale: Optional[float] = None, window: Optional[int] = None,
              softcap: Optional[float] = None) -> Reference:
    """softmax(mask(cap(q k^T * scale))) v and its gradients in float64 on the checked rows of the checked slices;
    documents come from inputs.doc_ids."""
    d_head, seq = inputs.q.shape[-1], inputs.q.shape[-2]
    scale = d_head**-0.5 if scale is None else scale
    slices = inputs.check_slices
    kv_slices, kv_index = _distinct(inputs.kv_slices())
    device = inputs.q.device
    rows = inputs.check_rows.to(device)

    def pick(t: torch.Tensor, which: list[int]) -> torch.Tensor:  # (batch, heads, seq, d) -> (which, seq, d) fp64
        return t.detach().reshape(-1, seq, d_head)[which].to(torch.float64)

    q = pick(inputs.q, slices).requires_grad_(True)
    k, v = (pick(t, kv_slices).requires_grad_(True) for t in (inputs.k, inputs.v))
    grad_out = pick(inputs.grad_out_check, slices)[:, rows]  # (slices, rows, d)
    keys = torch.arange(seq, device=device)[None, :]
    visible = torch.ones(len(rows), seq, dtype=torch.bool, device=device)  # (rows, seq)
    if causal:
        visible &= keys <= rows[:, None]
    if window is not None:
        distance = rows[:, None] - keys
        visible &= (distance < window) if causal else (distance.abs() < window)
    visible = visible.expand(len(slices), -1, -1)  # (slices, rows, seq)
    if inputs.doc_ids is not None:
        ids = inputs.doc_ids[[s // inputs.q.shape[1] for s in slices]]  # (slices, seq): each slice's sequence
        visible = visible & (ids.gather(1, rows.expand(len(slices), -1))[:, :, None] == ids[:, None, :])
    with torch.enable_grad():
        scores = q[:, rows] @ k[kv_index].transpose(-2, -1) * scale  # (slices, rows, seq)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v[kv_index]
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return Reference(out.detach(), dq, dk, dv)


def errors(ref: Reference, inputs: AttentionInputs, out: torch.Tensor, dtype: str,
           grads: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> dict[str, object]:
    """Max abs error of out (and dq, dk, dv when `grads` given) against `ref`; worst relative error; ok/FAIL.

    `out` and `grads` are the backend's full (batch, heads, seq, d_head) tensors from the correctness pass.
    """
    seq, d_head = out.shape[-2], out.shape[-1]
    rows = inputs.check_rows.to(out.device)
    kv_slices, _ = _distinct(inputs.kv_slices())

    def pick(t: torch.Tensor, which: list[int]) -> torch.Tensor:
        return t.detach().reshape(-1, seq, d_head)[which].to(torch.float64)

    pairs = {"out": (pick(out, inputs.check_slices)[:, rows], ref.out_rows)}
    if grads is not None:
        dq, dk, dv = grads
        pairs.update(dq=(pick(dq, inputs.check_slices), ref.dq), dk=(pick(dk, kv_slices), ref.dk),
                     dv=(pick(dv, kv_slices), ref.dv))
    row: dict[str, object] = {"err_out": None, "err_dq": None, "err_dk": None, "err_dv": None}
    worst = 0.0
    for name, (got, want) in pairs.items():
        err = float((got - want).abs().max())
        row[f"err_{name}"] = err
        # NaN from a broken kernel must not pass: max() ignores NaN ordering, so test explicitly.
        relative = err / max(float(want.abs().max()), 1e-30) if err == err else float("inf")
        worst = max(worst, relative)
    row["rel_err"] = worst
    row["check"] = "ok" if worst <= RELATIVE_TOLERANCE[dtype] else "FAIL"
    return row
