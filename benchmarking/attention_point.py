"""One point of an attention sweep: its shape, dtype, masking and variants, its FLOP count, and its random inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from attention.masks import doc_bounds

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Multipliers on the forward FLOP count: the backward does 2.5x the forward's matmul work
# (dV, dP, dQ, dK plus the recomputed QK^T of a fused kernel, counted as in the FlashAttention-2 paper).
PASS_FLOP_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass(frozen=True)
class AttentionPoint:
    """q shaped (batch, heads, seq, d_head) in `dtype`, k and v (batch, kv_heads, seq, d_head); causal or not; and
    the variants of attention/registry.py: a sliding window, a logit softcap, packed documents of mean length
    doc_len (drawn at random by make_inputs)."""

    batch: int
    heads: int
    seq: int
    d_head: int
    dtype: str  # a key of DTYPES
    causal: bool
    kv_heads: Optional[int] = None  # None: as many as heads
    window: Optional[int] = None
    softcap: Optional[float] = None
    doc_len: Optional[int] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seq, self.d_head)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads or self.heads, self.seq, self.d_head)

    def label(self) -> str:
        """Text naming the point, e.g. 'b8 h1 seq=1024 d=64 fp32 causal' (also matched by the OOM test hook), with
        the variants after it: 'kv8', 'window=1024', 'softcap=50', 'docs=1024'."""
        mask = "causal" if self.causal else "full"
        return " ".join([f"b{self.batch} h{self.heads} seq={self.seq} d={self.d_head} {self.dtype} {mask}",
                         *self.variant_labels()])

    def variant_labels(self) -> list[str]:
        labels = [f"kv{self.kv_heads}"] if self.kv_heads not in (None, self.heads) else []
        labels += [f"window={self.window}"] if self.window is not None else []
        labels += [f"softcap={self.softcap:g}"] if self.softcap is not None else []
        return labels + ([f"docs={self.doc_len}"] if self.doc_len is not None else [])

    def flop(self, pass_name: str = "fwd", pairs: Optional[float] = None) -> float:
        """FLOPs of one pass: forward 4*D FLOPs (two matmuls) per (query, key) score computed, times B*H; bwd 2.5x,
        fwd+bwd 3.5x. pairs: the scores per (batch, head), by default N^2, or N^2/2 when causal (the usual count);
        windows and documents pass the exact count (visible_pairs)."""
        if pairs is None:
            pairs = self.seq * self.seq / (2 if self.causal else 1)
        return 4.0 * self.batch * self.heads * pairs * self.d_head * PASS_FLOP_FACTOR[pass_name]

    def as_row(self) -> dict[str, object]:
        return {"batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads or self.heads, "seq": self.seq,
                "d_head": self.d_head, "dtype": self.dtype, "causal": self.causal, "window": self.window,
                "softcap": self.softcap, "doc_len": self.doc_len}


def visible_pairs(seq: int, causal: bool, window: Optional[int], doc_ids: Optional[torch.Tensor]) -> float:
    """(query, key) pairs that attention computes, per sequence: summed over the queries, averaged over doc_ids'
    sequences (batch, seq). In O(seq): each query sees one run of keys, cut by the causal edge, the window and its
    document's bounds."""
    device = doc_ids.device if doc_ids is not None else "cpu"
    i = torch.arange(seq, device=device, dtype=torch.int64)
    lo, hi = torch.zeros_like(i), (i if causal else torch.full_like(i, seq - 1))  # keys lo..hi inclusive
    if window is not None:
        lo = torch.maximum(lo, i - window + 1)
        if not causal:
            hi = torch.minimum(hi, i + window - 1)
    if doc_ids is not None:
        start, end = doc_bounds(doc_ids, tuple(doc_ids.shape[:-1]), seq)
        lo, hi = torch.maximum(lo, start.long()), torch.minimum(hi, end.long() - 1)
    return float((hi - lo + 1).clamp(min=0).sum(-1).double().mean())


def random_documents(batch: int, seq: int, mean_len: int, generator: torch.Generator) -> torch.Tensor:
    """doc_ids (batch, seq), int32: each sequence packed with documents of random length, uniform on
    1..2*mean_len-1 (mean `mean_len`), drawn afresh per sequence; the last one cut at seq."""
    rows = []
    for _ in range(batch):
        lengths = torch.randint(1, 2 * mean_len, (seq // mean_len * 2 + 2,), generator=generator)
        while int(lengths.sum()) < seq:
            lengths = torch.cat([lengths, torch.randint(1, 2 * mean_len, (seq // mean_len + 2,), generator=generator)])
        rows.append(torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)[:seq])
    return torch.stack(rows)


@dataclass
class AttentionInputs:
    """The tensors every backend at a point gets: the same q, k, v and upstream gradients."""

    q: torch.Tensor  # (batch, heads, seq, d_head), requires_grad
    k: torch.Tensor  # (batch, kv_heads, seq, d_head), requires_grad
    v: torch.Tensor
    grad_out: torch.Tensor  # upstream gradient for timing, dense random
    grad_out_check: torch.Tensor  # upstream gradient for the correctness pass: zero outside `check_rows`
    check_slices: list[int]  # indices into the flattened (batch*heads) dimension that are checked
    check_rows: torch.Tensor  # (rows,) query positions that are checked, sorted, int64
    doc_ids: Optional[torch.Tensor] = None  # (batch, seq) int32, when the point packs documents
    pairs: Optional[float] = None  # (query, key) scores per (batch, head) when windows or documents cut them

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]

    def kv_slices(self) -> list[int]:
        """The (batch, kv head) slices, in the flattened (batch*kv_heads) dimension, of k and v that
        check_slices' query heads read (GQA: query head h reads kv head h // group)."""
        heads, kv_heads = self.q.shape[1], self.k.shape[1]
        return [b * kv_heads + h // (heads // kv_heads) for b, h in (divmod(s, heads) for s in self.check_slices)]

    def nbytes(self) -> int:
        """Bytes of q, k, v and the two upstream gradients."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.grad_out, self.grad_out_check))


def check_rows(seq: int, max_rows: int = 64) -> torch.Tensor:
    """Query rows the float64 reference checks: all of them for short sequences, else `max_rows` spread over
    the whole sequence (first and last included), so every part of the causal mask is exercised."""
    if seq <= max_rows:
        return torch.arange(seq)
    return torch.linspace(0, seq - 1, max_rows).round().long().unique()


def check_slices(batch_heads: int) -> list[int]:
    """(batch, head) slices the reference checks: the first and the last (catches stride/offset bugs)."""
    return [0] if batch_heads == 1 else [0, batch_heads - 1]


def make_inputs(point: AttentionPoint, device: torch.device | str, seed: int = 0,
                max_check_rows: int = 64) -> AttentionInputs:
    """Fresh standard-normal q, k, v, grad_out for `point` (never zeros), and its documents, reproducible from
    `seed`."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(shape: tuple[int, ...] = point.shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(point.torch_dtype)

    q, k, v = (randn(shape).requires_grad_(True) for shape in (point.shape, point.kv_shape, point.kv_shape))
    grad_out = randn()
    doc_ids = None
    if point.doc_len is not None:
        doc_ids = random_documents(point.batch, point.seq, point.doc_len,
                                   torch.Generator().manual_seed(seed)).to(device)
    pairs = None
    if point.window is not None or doc_ids is not None:
        pairs = visible_pairs(point.seq, point.causal, point.window, doc_ids)
    rows = check_rows(point.seq, max_check_rows)
    slices = check_slices(point.batch * point.heads)
    # Only checked rows of checked slices carry gradient, so the float64 reference needs just those rows
    # of the score matrix and still gives exact dk and dv for the whole slice.
    keep = torch.zeros(point.batch * point.heads, point.seq, 1, dtype=torch.bool, device=device)
    keep[torch.tensor(slices, device=device)[:, None], rows.to(device)[None, :]] = True
    grad_out_check = (randn().reshape(-1, point.seq, point.d_head) * keep).reshape(point.shape)
    return AttentionInputs(q, k, v, grad_out, grad_out_check, slices, rows, doc_ids, pairs)


def variant_kwargs(point: AttentionPoint, inputs: AttentionInputs) -> dict[str, Any]:
    """The keyword arguments of an attention call at this point beyond causal: window, softcap, doc_ids."""
    return {"window": point.window, "softcap": point.softcap, "doc_ids": inputs.doc_ids}


def parse_dtype(name: str) -> str:
    """Validate a dtype name ('fp32', 'fp16', 'bf16'); raises ValueError naming the valid ones."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return name

