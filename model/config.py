"""Model configuration: a dataclass plus named size presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    vocab_size: int = 10_000
    context_length: int = 1024
    rope_theta: float = 10_000.0
    attn: str = "sdpa"  # attention backend name, looked up in the registry
    # Attention variants (attention/registry.py). n_kv_heads: key/value heads (GQA; None: n_heads). window: the
    # sliding window of the local layers; window_pattern says which layers are local (L) and global (G), repeated
    # over the layers: "LLLG" is three local then one global. attn_softcap: logit soft-capping of every layer.
    n_kv_heads: Optional[int] = None
    window: Optional[int] = None
    window_pattern: str = "L"
    attn_softcap: Optional[float] = None
    # Under bf16/fp16 autocast, Linear weight gradients come out of the matmul in fp32 (model/layers.py); False: as
    # plain autocast, rounded to the low dtype and then cast. Changes no parameter, only how dW is computed.
    fp32_weight_grads: bool = True
    # On CUDA, q, k and v leave the fused projection with RoPE applied in one Triton kernel, and their gradients
    # return in one (model/fused_rope.py); False: in PyTorch ops. Changes no parameter and no value beyond rounding.
    fused_rope: bool = True
    # Under bf16/fp16 autocast, the residual stream (the embeddings and each block's sums) stays fp32, as autocast
    # leaves it (nanoGPT's numerics); False: it runs in the autocast dtype, as in a model whose weights are bf16
    # (Megatron-LM's default, torchtitan's bf16 parameters). Changes no parameter; halves the bytes that each
    # residual add and RMSNorm moves.
    fp32_residual: bool = True
    # Where Linear weight gradients are fp32 (above) under bf16/fp16 autocast, SwiGLU's w1 and w3 run as one matmul
    # against their concatenated weights, forward and backward (model/layers.py); False: two. Changes no parameter
    # and no value beyond rounding.
    fused_gate_up: bool = True

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.d_head % 2:
            raise ValueError(f"RoPE needs an even d_head, got d_model/n_heads = {self.d_head}")
        if self.n_kv_heads is not None and not (1 <= self.n_kv_heads <= self.n_heads
                                                and self.n_heads % self.n_kv_heads == 0):
            raise ValueError(f"n_kv_heads must divide n_heads ({self.n_heads}), got {self.n_kv_heads}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not self.window_pattern or set(self.window_pattern) - {"L", "G"}:
            raise ValueError(f"window_pattern must be letters L (local) and G (global), got {self.window_pattern!r}")
        if self.window is None and self.window_pattern != "L":
            raise ValueError(f"window_pattern {self.window_pattern} needs window (the local layers' window)")
        if self.attn_softcap is not None and not self.attn_softcap > 0:
            raise ValueError(f"attn_softcap must be > 0, got {self.attn_softcap}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of block `layer`: `window` where window_pattern marks it local, else None."""
        if self.window is None or self.window_pattern[layer % len(self.window_pattern)] == "G":
            return None
        return self.window

    def to_dict(self) -> dict:
        return asdict(self)


# name: (d_model, d_ff, n_layers, n_heads); small..2.7B as in the CS336 size table.
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (256, 1024, 4, 4),  # not in the CS336 table: a quick CPU run
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7B": (2560, 10240, 32, 32),
    "10B": (4608, 12288, 50, 36),
}


def config_for(size: str, **overrides) -> ModelConfig:
    """The preset `size` with any field overridden, e.g. config_for("small", attn="flash")."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(PRESETS)}")
    d_model, d_ff, n_layers, n_heads = PRESETS[size]
    base = ModelConfig(d_model=d_model, d_ff=d_ff, n_layers=n_layers, n_heads=n_heads)
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
