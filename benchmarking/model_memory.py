"""Expected memory of a TransformerLM step, term by term, for `bench_model.py --explain-memory`.

The accounting follows what autograd saves for backward in `model/` (checked against
`measure_saved_bytes`, which records every tensor saved during a forward pass):

- parameters, gradients and AdamW's two fp32 moments: 4 bytes per parameter each (the moments 2 bytes each with
  `--optim-state-dtype bf16`);
- bf16 autocast adds a bf16 copy of every matmul weight (saved by each Linear for backward; kept between steps by
  the optimizer with bf16 state);
- per layer, activations linear in context T (RMSNorm inputs and normalised x, the qkv input, RoPE'd q and k, v,
  the attention output, the SwiGLU w1/w3 outputs, silu and the product) and, for the naive backends, the
  softmax probabilities, which grow with T^2;
- the log-probabilities of the loss (batch * T * vocab * 4 bytes), plus the logits themselves while the loss runs.

Byte counts are exact for what they name; the expected peak adds the transient working set that is alive at
the worst moment (one layer's attention scores, the logits and their gradients) and is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from model.config import ModelConfig

# Backends that build the (T, T) score matrix and keep the softmax output for backward.
MATERIALISING_BACKENDS = frozenset({"naive", "compiled"})
MODES = ("forward", "forward-backward", "train-step")
FP32, BF16 = 4, 2


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    nbytes: int
    formula: str  # how nbytes was computed, in the config's symbols


@dataclass
class MemorySection:
    title: str
    terms: list[MemoryTerm] = field(default_factory=list)
    repeat: int = 1  # e.g. n_layers for the per-layer activations

    @property
    def nbytes(self) -> int:
        return self.repeat * sum(t.nbytes for t in self.terms)

    def add(self, name: str, nbytes: int, formula: str) -> None:
        self.terms.append(MemoryTerm(name, int(nbytes), formula))


@dataclass
class MemoryBreakdown:
    cfg: ModelConfig
    batch: int
    seq: int
    dtype: str
    mode: str
    param_count: int
    state: list[MemorySection]  # parameters, gradients, optimizer state, autocast weight copies
    saved: list[MemorySection]  # activations saved for backward
    transient: MemorySection  # the working set alive at the peak on top of the above
    attn: str = "sdpa"  # the attention backend: those that materialise the scores save them

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    @property
    def expected_peak_bytes(self) -> int:
        return self.state_bytes + self.saved_bytes + self.transient.nbytes


def param_count(cfg: ModelConfig) -> int:
    """Exactly TransformerLM(cfg).num_params(): embedding, blocks, final norm, untied LM head."""
    d, f, v, kv = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.kv_heads * cfg.d_head
    mlp = cfg.mlp_matrices * d * f  # SwiGLU's w1 w2 w3 or ReLU²'s w1 w2
    per_layer = d * (d + 2 * kv) + d * d + mlp + 2 * d  # qkv (k, v: kv heads), out-proj, the MLP, 2 gains
    return v * d + cfg.n_layers * per_layer + d + d * v


def matmul_weight_count(cfg: ModelConfig) -> int:
    """Parameters that autocast casts to bf16: every Linear weight (not the embedding or norm gains)."""
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.kv_heads * cfg.d_head
    return cfg.n_layers * (d * (d + 2 * kv) + d * d + cfg.mlp_matrices * d * f) + d * cfg.vocab_size


def _check(dtype: str, mode: str, batch: int, seq: int) -> None:
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch}, {seq}")


def layer_activations(cfg: ModelConfig, batch: int, seq: int, dtype: str, device_type: str = "cuda",
                      attn: str = "sdpa") -> MemorySection:
    """What one Block saves for backward; `dtype` 'bf16' means autocast (matmul outputs and the residual stream in
    bf16)."""
    B, T, d, h, f = batch, seq, cfg.d_model, cfg.n_heads, cfg.d_ff
    a = BF16 if dtype == "bf16" else FP32  # bytes of a matmul input/output
    btd, a_name = B * T * d, "a"
    sec = MemorySection(f"activations saved per layer (x {cfg.n_layers} layers)", repeat=cfg.n_layers)
    # RMSNorm computes in fp32: what it saves of its input is the fp32 upcast of a bf16 residual stream.
    upcast = "; its RMSNorm saves it upcast to fp32" if a == BF16 else ""
    sec.add(f"block input x (residual stream, {'bf16' if a == BF16 else 'fp32'}; attn RMSNorm input{upcast})",
            4 * btd, "B*T*d*4")
    sec.add("attn RMSNorm: x*rsqrt (fp32) and rsqrt", 4 * btd + 4 * B * T, "B*T*d*4 + B*T*4")
    sec.add("qkv input (RMSNorm output" + (", bf16 cast)" if a == BF16 else ")"), a * btd, f"B*T*d*{a_name}")
    if cfg.kv_heads == h or attn in MATERIALISING_BACKENDS:  # their batched matmuls save k and v copied to h heads
        sec.add("RoPE'd q and k", 2 * a * btd, f"2*B*T*d*{a_name}")
        sec.add("v (its own copy, not a view that would keep the qkv output alive)", a * btd, f"B*T*d*{a_name}")
    else:  # GQA: k and v have the key/value heads only
        kv = B * T * cfg.kv_heads * cfg.d_head
        sec.add("RoPE'd q and k (k: the key/value heads)", a * (btd + kv), f"B*T*(d+kv*d_head)*{a_name}")
        sec.add("v (its own copy, not a view that would keep the qkv output alive)", a * kv,
                f"B*T*kv*d_head*{a_name}")
    if attn in MATERIALISING_BACKENDS:
        sec.add("causal mask (bool)", T * T, "T^2")
        if a == BF16 and device_type == "cuda":
            # CUDA autocast runs softmax in fp32, then casts the probs to bf16 for probs @ v: both are saved.
            sec.add("attention probs (softmax output, fp32)", 4 * B * h * T * T, "B*h*T^2*4")
            sec.add("attention probs, bf16 copy for probs @ v", BF16 * B * h * T * T, "B*h*T^2*2")
        else:  # fp32, or CPU autocast, which keeps softmax in bf16
            sec.add("attention probs (softmax output)", a * B * h * T * T, f"B*h*T^2*{a_name}")
        sec.add("out-proj input (heads merged: a copy of probs @ v)", a * btd, f"B*T*d*{a_name}")
    else:
        # o comes in q's (batch, seq, heads, d) memory order, so merging the heads for the out-projection is a view.
        sec.add("attention output o (saved by the fused kernel; the out-proj input views it)", a * btd,
                f"B*T*d*{a_name}")
        sec.add("softmax logsumexp (fp32)", 4 * B * h * T, "B*h*T*4")
    sec.add(f"residual after attention ({'bf16' if a == BF16 else 'fp32'}; FFN RMSNorm input{upcast})", 4 * btd,
            "B*T*d*4")
    sec.add("FFN RMSNorm: x*rsqrt (fp32) and rsqrt", 4 * btd + 4 * B * T, "B*T*d*4 + B*T*4")
    if a == BF16:
        # One matmul for w1 and w3 (model.layers.SwiGLU): one bf16 cast of its input. On CUDA the activation's kernel
        # (model.fused_swiglu) saves the projection alone and recomputes silu in its backward.
        sec.add("w1/w3 input (RMSNorm output, one bf16 cast for their fused matmul)", a * btd, f"B*T*d*{a_name}")
        if device_type == "cuda":
            sec.add("SwiGLU gate/up projection (w1 x, w3 x), silu*w3 (w2 input)", 3 * a * B * T * f,
                    f"3*B*T*d_ff*{a_name}")
        else:
            sec.add("SwiGLU gate/up projection (w1 x, w3 x), silu(w1 x), silu*w3 (w2 input)", 4 * a * B * T * f,
                    f"4*B*T*d_ff*{a_name}")
        return sec
    # Autocast casts the (fp32) norm output once per matmul, so w1 and w3 each keep their own bf16 copy.
    copies = 2 if a == BF16 else 1
    sec.add("w1/w3 input (RMSNorm output" + (", one bf16 cast each)" if a == BF16 else ")"), copies * a * btd,
            f"{copies}*B*T*d*{a_name}" if copies > 1 else f"B*T*d*{a_name}")
    sec.add("SwiGLU w1 output, silu(w1 x), w3 output, silu*w3 (w2 input)", 4 * a * B * T * f, f"4*B*T*d_ff*{a_name}")
    return sec


def head_activations(cfg: ModelConfig, batch: int, seq: int, dtype: str) -> MemorySection:
    """Saved once per model: token ids, RoPE tables, final norm, LM head input, the loss's log-probs."""
    B, T, d, V = batch, seq, cfg.d_model, cfg.vocab_size
    a = BF16 if dtype == "bf16" else FP32
    sec = MemorySection("activations saved once (embedding, final norm, LM head, loss)")
    sec.add("token ids and targets (int64), loss total-weight scalar", 2 * 8 * B * T + 4, "2*B*T*8 + 4")
    sec.add("RoPE cos/sin tables (fp32, shared by all layers)", 2 * 4 * T * (cfg.d_head // 2), "2*T*(d_head/2)*4")
    sec.add("final RMSNorm: input, x*rsqrt (fp32) and rsqrt", 8 * B * T * d + 4 * B * T, "2*B*T*d*4 + B*T*4")
    sec.add("LM head input" + (" (bf16 cast)" if a == BF16 else ""), a * B * T * d, "B*T*d*a")
    sec.add("log-softmax of the logits (fp32, saved by cross-entropy)", 4 * B * T * V, "B*T*V*4")
    return sec


def explain_memory(cfg: ModelConfig, batch: int, seq: int, dtype: str, mode: str, device_type: str = "cuda",
                   attn: str = "sdpa", optimizer: str = "adamw") -> MemoryBreakdown:
    """The expected memory of one `mode` step of TransformerLM(cfg, attn) on (batch, seq) tokens on `device_type`,
    with `optimizer` (adamw: fp32 moments; adamw-bf16: bf16 moments; muon: a momentum per block matrix, AdamW's
    moments for the rest)."""
    _check(dtype, mode, batch, seq)
    if cfg.mlp != "swiglu" or cfg.qk_norm or cfg.logit_softcap:
        raise ValueError("the memory model describes SwiGLU blocks without QK-norm and an LM head without a softcap")
    P = param_count(cfg)
    B, T, V, h = batch, seq, cfg.vocab_size, cfg.n_heads
    a = BF16 if dtype == "bf16" else FP32
    n_tensors = 4 + 9 * cfg.n_layers  # parameter tensors: embed, final norm, head + 9 per block (incl. qkv, out)

    state = MemorySection("model state")
    state.add("parameters (fp32 master weights)", 4 * P, "P*4")
    if mode != "forward":
        state.add("gradients (fp32)", 4 * P, "P*4")
    if mode == "train-step":
        if optimizer == "adamw-bf16":
            state.add("AdamW exp_avg and exp_avg_sq (bf16)", 4 * P, "2*P*2")
        elif optimizer == "muon":
            hidden = matmul_weight_count(cfg) - cfg.d_model * V  # the blocks' matrices (not the LM head)
            state.add("Muon momentum of the blocks' matrices (fp32)", 4 * hidden, "P_blocks*4")
            state.add("AdamW exp_avg and exp_avg_sq of the rest (fp32)", 8 * (P - hidden), "2*(P-P_blocks)*4")
        else:
            state.add("AdamW exp_avg and exp_avg_sq (fp32)", 8 * P, "2*P*4")
        state.add("AdamW step counters", 4 * n_tensors, "one fp32 per parameter tensor")
    if a == BF16:
        state.add("autocast bf16 copies of matmul weights", BF16 * matmul_weight_count(cfg), "P_matmul*2")

    transient = MemorySection("transient working set at the peak (estimate)")
    logits = a * B * T * V
    if mode == "forward":
        # No graph: at the loss, the logits, their fp32 cast under autocast, and the log-probs are alive.
        transient.add("logits" + (" (bf16) + fp32 cast" if a == BF16 else ""), logits + (4 * B * T * V if a == BF16 else 0),
                      "B*T*V*a (+ B*T*V*4)")
        transient.add("log-probs (fp32)", 4 * B * T * V, "B*T*V*4")
        return MemoryBreakdown(cfg, B, T, dtype, mode, P, [state], [], transient, attn)

    saved = [layer_activations(cfg, B, T, dtype, device_type, attn), head_activations(cfg, B, T, dtype)]
    # Start of backward: the gradient of the log-probs and of the logits (fp32; bf16 copy under autocast).
    transient.add("gradient of log-probs and of logits (fp32)", 8 * B * T * V, "2*B*T*V*4")
    if a == BF16:
        transient.add("gradient of logits, bf16 cast for the LM head", BF16 * B * T * V, "B*T*V*2")
    if attn in MATERIALISING_BACKENDS:
        # Backward of one layer's attention holds grad(probs) and grad(scores) at once.
        transient.add("one layer's grad of probs and of scores (fp32)", 8 * B * h * T * T, "2*B*h*T^2*4")
    return MemoryBreakdown(cfg, B, T, dtype, mode, P, [state], saved, transient, attn)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_breakdown(mb: MemoryBreakdown, measured: Iterable[tuple[str, int | None]] = ()) -> str:
    """A plain-text table of every term, section totals and the expected peak, beside measured figures."""
    cfg = mb.cfg
    lines = [
        f"Expected memory: d_model={cfg.d_model} n_layers={cfg.n_layers} n_heads={cfg.n_heads} d_ff={cfg.d_ff} "
        f"vocab={cfg.vocab_size} attn={mb.attn} | batch B={mb.batch} context T={mb.seq} | {mb.dtype} | {mb.mode}",
        f"P = {mb.param_count:,} parameters; a = {BF16 if mb.dtype == 'bf16' else FP32} bytes per matmul activation",
        "",
    ]
    width = 66
    for sec in [*mb.state, *mb.saved, mb.transient]:
        lines.append(f"{sec.title}")
        for t in sec.terms:
            lines.append(f"  {t.name:<{width}} {_fmt_bytes(t.nbytes):>11}   {t.formula}")
        label = f"subtotal (x {sec.repeat})" if sec.repeat > 1 else "subtotal"
        lines.append(f"  {label:<{width}} {_fmt_bytes(sec.nbytes):>11}")
        lines.append("")
    lines.append(f"{'expected activations saved for backward':<{width + 2}} {_fmt_bytes(mb.saved_bytes):>11}")
    lines.append(f"{'expected peak (state + saved + transient)':<{width + 2}} {_fmt_bytes(mb.expected_peak_bytes):>11}")
    for name, value in measured:
        shown = "n/a" if value is None else _fmt_bytes(value)
        lines.append(f"{name:<{width + 2}} {shown:>11}")
    return "\n".join(lines)


def measure_saved_bytes(run_forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of distinct storages autograd saves while `run_forward()` runs, not counting `exclude` (the parameters).

    Works on any device, so the CPU tests can check the accounting above. The returned graph (if any) must be
    kept alive by the caller until this returns; storages are counted once however many tensors view them.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage  # holding it keeps the address from being reused while we count
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    total = sum(s.nbytes() for s in seen.values())
    del out
    return total
