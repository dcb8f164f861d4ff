"""Why each attention backend needs the memory it does: expected tensors saved for backward, and measured.

Two measurements, and a model to set them against:
- `SavedTensorRecorder`: the distinct storages autograd keeps for backward during a forward pass (any device),
  via `torch.autograd.graph.saved_tensors_hooks`.
- the CUDA allocator's growth over the forward pass (bench_attention's `saved_mib`): saved tensors + output.
- `expected_tensors(backend, point)`: what each family of backend should keep, from its algorithm:
  naive keeps the (seq x seq) probabilities, so O(seq^2); fused kernels keep q, k, v, o and one
  float32 log-sum-exp per row, so O(seq).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from benchmarking.attention_point import DTYPE_NAMES, AttentionPoint

# Registry name -> memory family. Names not listed get no model, only the measured figures.
FAMILIES: dict[str, str] = {
    "naive": "naive",
    "compiled": "compiled",
    "flash": "fused",
    "flash-torch": "fused",
    "sdpa": "fused",
    "sdpa-flash": "fused",
    "sdpa-cudnn": "fused",
    "flex": "fused",
}

FAMILY_NOTES: dict[str, str] = {
    "naive": "keeps the softmax probabilities P (batch x heads x seq x seq) for backward: O(seq^2). The raw "
             "scores S = q k^T (same size) exist only during the forward: they set its peak, and a naive "
             "implementation that also kept S would save twice P.",
    "compiled": "torch.compile decides: Inductor may rewrite the matmul-softmax-matmul into a fused SDPA "
                "kernel (then it keeps q, k, v, o and row statistics: O(seq)), or keep P like naive "
                "(O(seq^2)); the model below is the O(seq^2) case, the measured lines show what it chose.",
    "fused": "never materialises P: keeps q, k, v, the output o and one float32 log-sum-exp L per query row, "
             "and recomputes P block by block in backward: O(seq).",
}


@dataclass(frozen=True)
class ExpectedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "input" (exists before forward), "saved", "output", "output+saved", "transient" (forward peak)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def expected_tensors(backend: str, point: AttentionPoint) -> Optional[list[ExpectedTensor]]:
    """The tensors `backend` should hold around its forward pass at `point`; None for an unmodelled backend."""
    family = FAMILIES.get(backend)
    if family is None:
        return None
    b, h, n, d, dt = point.batch, point.heads, point.seq, point.d_head, point.torch_dtype
    tensors = [ExpectedTensor(name, (b, h, n, d), dt, "input") for name in ("q", "k", "v")]
    if family in ("naive", "compiled"):
        tensors.append(ExpectedTensor("P = softmax(S) probabilities", (b, h, n, n), dt, "saved"))
        if point.causal:
            tensors.append(ExpectedTensor("causal mask", (n, n), torch.bool, "saved"))
        tensors.append(ExpectedTensor("o output", (b, h, n, d), dt, "output"))
        tensors.append(ExpectedTensor("S = q k^T * scale scores", (b, h, n, n), dt, "transient"))
    else:
        tensors.append(ExpectedTensor("o output", (b, h, n, d), dt, "output+saved"))
        tensors.append(ExpectedTensor("L log-sum-exp per row", (b, h, n), torch.float32, "saved"))
    return tensors


def expected_after_forward_bytes(tensors: Sequence[ExpectedTensor]) -> int:
    """New memory alive after the forward: saved tensors plus the output (inputs existed before)."""
    return sum(t.nbytes for t in tensors if t.kind in ("saved", "output", "output+saved"))


def expected_forward_peak_bytes(tensors: Sequence[ExpectedTensor]) -> int:
    """New memory at the forward's peak: what stays after it, plus transients alive together with it."""
    return expected_after_forward_bytes(tensors) + sum(t.nbytes for t in tensors if t.kind == "transient")


def expected_saved_bytes(tensors: Sequence[ExpectedTensor]) -> int:
    """Memory kept for backward other than the inputs q, k, v."""
    return sum(t.nbytes for t in tensors if t.kind in ("saved", "output+saved"))


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of its whole storage


class SavedTensorRecorder:
    """Records the distinct storages autograd saves for backward while active, except `exclude`'s storages.

        with SavedTensorRecorder(exclude=[q, k, v]) as rec:
            o = attention(q, k, v)
        rec.total_bytes, rec.tensors
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, SavedTensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen[key] = SavedTensor(tuple(t.shape), t.dtype, storage.nbytes())
        return t  # keep the tensor itself: no copy, no extra memory

    def __enter__(self) -> "SavedTensorRecorder":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def tensors(self) -> list[SavedTensor]:
        return list(self._seen.values())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._seen.values())


def _size(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "n/a"
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= factor:
            return f"{nbytes / factor:.2f} {unit}"
    return f"{int(nbytes)} B"


def _dtype(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def explain_backend(backend: str, point: AttentionPoint, measured: dict[str, object],
                    saved: Optional[Sequence[SavedTensor]]) -> str:
    """Text block: expected tensors with bytes, then expected vs measured totals for one backend.

    `measured` is a bench_attention row (saved_mib, fwd_peak_mib, saved_tensors_mib, status, note);
    `saved` the recorder's tensors from the same forward, or None when the forward did not run.
    """
    mib = 1024**2
    lines = [f"[{backend}]"]
    tensors = expected_tensors(backend, point)
    if tensors is None:
        lines.append("  no memory model for this backend; measured figures only")
    else:
        lines.append("  " + FAMILY_NOTES[FAMILIES[backend]])
        for t in tensors:
            shape = "x".join(str(s) for s in t.shape)
            lines.append(f"  {t.kind:<12} {t.name:<30} {shape:<22} {_dtype(t.dtype):<5} {_size(t.nbytes):>11}")
    status, note = measured.get("status"), measured.get("note")
    if status not in (None, "ok"):
        lines.append(f"  measured: {status}" + (f" ({note})" if note else ""))
    elif note:
        lines.append(f"  note: {note}")

    def from_mib(key: str) -> Optional[float]:
        value = measured.get(key)
        return None if value is None else float(value) * mib

    after = expected_after_forward_bytes(tensors) if tensors else None
    peak = expected_forward_peak_bytes(tensors) if tensors else None
    saved_only = expected_saved_bytes(tensors) if tensors else None
    lines.append(f"  after forward (saved + output): expected {_size(after)}, "
                 f"measured {_size(from_mib('saved_mib'))} (CUDA allocated after forward - before)")
    lines.append(f"  forward peak above inputs:      expected {_size(peak)}, measured {_size(from_mib('fwd_peak_mib'))}")
    lines.append(f"  saved for backward (not q,k,v): expected {_size(saved_only)}, "
                 f"measured {_size(from_mib('saved_tensors_mib'))} (autograd saved-tensor hooks)")
    if saved:
        listed = ", ".join(f"{'x'.join(map(str, s.shape))} {_dtype(s.dtype)} {_size(s.nbytes)}" for s in saved)
        lines.append(f"  measured saved tensors: {listed}")
    return "\n".join(lines)


def explain_header(point: AttentionPoint, device: torch.device | str) -> str:
    n2 = point.batch * point.heads * point.seq * point.seq
    element = torch.empty((), dtype=point.torch_dtype).element_size()
    return (f"Memory around the forward pass at {point.label()} on {device}.\n"
            f"One (batch x heads x seq x seq) matrix is {point.batch}x{point.heads}x{point.seq}^2 x {element} B "
            f"= {_size(n2 * element)}; one (batch x heads x seq x d_head) tensor is {_size(n2 // point.seq * point.d_head * element)}.\n"
            "kinds: input = exists before forward; saved = kept for backward; output = o (alive after forward);"
            " transient = alive during the forward only.")
