"""Float64 reference for attention outputs and gradients on sampled rows, and errors against it.

The reference never builds the full (seq x seq) matrix: it takes the checked (batch, head) slices and,
within them, the checked query rows only (rows x seq scores, float64). Because the correctness pass's
upstream gradient is zero outside those rows, that is enough for exact dq (all rows: zero elsewhere),
dk and dv of the checked slices. So it works where naive itself would run out of memory.
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
    dk: torch.Tensor
    dv: torch.Tensor


def reference(inputs: AttentionInputs, causal: bool, scale: Optional[float] = None) -> Reference:
    """softmax(q k^T * scale) v and its gradients in float64 on the checked rows of the checked slices."""
    d_head, seq = inputs.q.shape[-1], inputs.q.shape[-2]
    scale = d_head**-0.5 if scale is None else scale
    slices = inputs.check_slices
    rows = inputs.check_rows.to(inputs.q.device)

    def pick(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, d) -> (slices, seq, d) float64
        return t.detach().reshape(-1, seq, d_head)[slices].to(torch.float64)

    q, k, v = (pick(t).requires_grad_(True) for t in inputs.leaves())
    grad_out = pick(inputs.grad_out_check)[:, rows]  # (slices, rows, d)
    with torch.enable_grad():
        scores = q[:, rows] @ k.transpose(-2, -1) * scale  # (slices, rows, seq)
        if causal:
            keys = torch.arange(seq, device=rows.device)
            scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return Reference(out.detach(), dq, dk, dv)


def errors(ref: Reference, inputs: AttentionInputs, out: torch.Tensor, dtype: str,
           grads: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> dict[str, object]:
    """Max abs error of out (and dq, dk, dv when `grads` given) against `ref`; worst relative error; ok/FAIL.

    `out` and `grads` are the backend's full (batch, heads, seq, d_head) tensors from the correctness pass.
    """
    seq, d_head = out.shape[-2], out.shape[-1]
    slices, rows = inputs.check_slices, inputs.check_rows.to(out.device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1, seq, d_head)[slices].to(torch.float64)

    pairs = {"out": (pick(out)[:, rows], ref.out_rows)}
    if grads is not None:
        pairs.update({name: (pick(g), r) for name, g, r in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv))})
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
