"""What the model is: a dataclass of its architecture, and named size presets. How it runs lives in training/config.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional


MLPS = {"swiglu": 3, "relu2": 2}  # name: its matrices


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    vocab_size: int = 10_000
    context_length: int = 1024
    rope_theta: float = 10_000.0
    # Attention variants (attention/registry.py). n_kv_heads: key/value heads (GQA; None: n_heads). window: the
    # sliding window of the local layers; window_pattern says which layers are local (L) and global (G), repeated
    # over the layers: "LLLG" is three local then one global. attn_softcap: logit soft-capping of every layer.
    n_kv_heads: Optional[int] = None
    window: Optional[int] = None
    window_pattern: str = "L"
    attn_softcap: Optional[float] = None
    # Recipe options (training/recipes.py; docs/training.md has what each bought). qk_norm: each head's queries
    # and keys RMS-normalised (no gain) before attention. mlp: "swiglu" w2(silu(w1 x) * w3 x), or "relu2"
    # w2(relu(w1 x)^2), two matrices. zero_init_residual: the attention output and MLP down projections start at
    # zero, so that each block starts as the identity. logit_softcap: the LM head's logits capped at c * tanh(z / c).
    qk_norm: bool = False
    mlp: str = "swiglu"
    zero_init_residual: bool = False
    logit_softcap: Optional[float] = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> Optional[str]:
        """The first rule the fields break, in their own names; None if they are consistent."""
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size", "context_length"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        if self.d_model % self.n_heads:
            return f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
        if self.d_head % 2:
            return f"RoPE needs an even d_head, got d_model/n_heads = {self.d_head}"
        if self.n_kv_heads is not None and not (1 <= self.n_kv_heads <= self.n_heads
                                                and self.n_heads % self.n_kv_heads == 0):
            return f"n_kv_heads must divide n_heads ({self.n_heads}), got {self.n_kv_heads}"
        if self.window is not None and self.window < 1:
            return f"window must be >= 1, got {self.window}"
        if not self.window_pattern or set(self.window_pattern) - {"L", "G"}:
            return f"window_pattern must be letters L (local) and G (global), got {self.window_pattern!r}"
        if self.window is None and self.window_pattern != "L":
            return f"window_pattern {self.window_pattern} needs window (the local layers' window)"
        if self.attn_softcap is not None and not self.attn_softcap > 0:
            return f"attn_softcap must be > 0, got {self.attn_softcap}"
        if self.mlp not in MLPS:
            return f"mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}"
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            return f"logit_softcap must be > 0, got {self.logit_softcap}"
        return None

    @property
    def mlp_matrices(self) -> int:
        """d_model x d_ff matrices per MLP: SwiGLU's w1, w3, w2, or ReLU²'s w1, w2."""
        return MLPS[self.mlp]

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

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """The config of a saved dict; keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


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
    """The preset `size` with any field overridden (None leaves the preset's), e.g. config_for("small", window=256)."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(PRESETS)}")
    d_model, d_ff, n_layers, n_heads = PRESETS[size]
    base = dict(d_model=d_model, d_ff=d_ff, n_layers=n_layers, n_heads=n_heads)
    return ModelConfig(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


def preset_of(cfg: ModelConfig) -> Optional[str]:
    """The name of the preset whose shape `cfg` has, or None."""
    shape = (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads)
    return next((name for name, preset in PRESETS.items() if preset == shape), None)


__all__ = ["ModelConfig", "PRESETS", "config_for", "preset_of"]
