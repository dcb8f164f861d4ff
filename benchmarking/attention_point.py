"""One point of an attention sweep: its shape, dtype and masking, its FLOP count, and its random inputs."""

from __future__ import annotations

from dataclasses import dataclass
import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Multipliers on the forward FLOP count: the backward does 2.5x the forward's matmul work
# (dV, dP, dQ, dK plus the recomputed QK^T of a fused kernel, counted as in the FlashAttention-2 paper).
PASS_FLOP_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass(frozen=True)
class AttentionPoint:
    """q, k, v shaped (batch, heads, seq, d_head) in `dtype`; causal or not."""

    batch: int
    heads: int
    seq: int
    d_head: int
    dtype: str  # a key of DTYPES
    causal: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seq, self.d_head)

    def label(self) -> str:
        """Text naming the point, e.g. 'b8 h1 seq=1024 d=64 fp32 causal' (also matched by the OOM test hook)."""
        mask = "causal" if self.causal else "full"
        return f"b{self.batch} h{self.heads} seq={self.seq} d={self.d_head} {self.dtype} {mask}"

    def flop(self, pass_name: str = "fwd") -> float:
        """FLOPs of one pass: forward 4*B*H*N^2*D (two matmuls), halved when causal; bwd 2.5x, fwd+bwd 3.5x."""
        forward = 4.0 * self.batch * self.heads * self.seq * self.seq * self.d_head
        if self.causal:
            forward /= 2
        return forward * PASS_FLOP_FACTOR[pass_name]

    def as_row(self) -> dict[str, object]:
        return {"batch": self.batch, "heads": self.heads, "seq": self.seq, "d_head": self.d_head,
                "dtype": self.dtype, "causal": self.causal}


@dataclass
class AttentionInputs:
    """The tensors every backend at a point gets: the same q, k, v and upstream gradients."""

    q: torch.Tensor  # (batch, heads, seq, d_head), requires_grad
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor  # upstream gradient for timing, dense random
    grad_out_check: torch.Tensor  # upstream gradient for the correctness pass: zero outside `check_rows`
    check_slices: list[int]  # indices into the flattened (batch*heads) dimension that are checked
    check_rows: torch.Tensor  # (rows,) query positions that are checked, sorted, int64

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v]

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
    """Fresh standard-normal q, k, v, grad_out for `point` (never zeros), reproducible from `seed`."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(point.shape, generator=generator, device=device, dtype=torch.float32).to(point.torch_dtype)

    q, k, v = (randn().requires_grad_(True) for _ in range(3))
    grad_out = randn()
    rows = check_rows(point.seq, max_check_rows)
    slices = check_slices(point.batch * point.heads)
    # Only checked rows of checked slices carry gradient, so the float64 reference needs just those rows
    # of the score matrix and still gives exact dk and dv for the whole slice.
    keep = torch.zeros(point.batch * point.heads, point.seq, 1, dtype=torch.bool, device=device)
    keep[torch.tensor(slices, device=device)[:, None], rows.to(device)[None, :]] = True
    grad_out_check = (randn().reshape(-1, point.seq, point.d_head) * keep).reshape(point.shape)
    return AttentionInputs(q, k, v, grad_out, grad_out_check, slices, rows)


def parse_dtype(name: str) -> str:
    """Validate a dtype name ('fp32', 'fp16', 'bf16'); raises ValueError naming the valid ones."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return name

