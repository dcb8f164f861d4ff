"""Throughput and memory figures: FLOPs per token, MFU against a peak table, CUDA memory stats."""

from __future__ import annotations

from typing import Optional

import torch

from model.config import ModelConfig

# Dense bf16 tensor-core peak, FLOP/s, by substring of torch.cuda.get_device_name(). The first match wins,
# so more specific names come first. An unknown GPU gets no MFU rather than a guessed one.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


def peak_flops(device: torch.device | str) -> Optional[float]:
    """Dense bf16 peak of `device` in FLOP/s, or None (CPU or a GPU not in the table)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def non_embedding_params(cfg: ModelConfig) -> int:
    """Parameters other than the token embedding, from the config alone (GQA: k and v project to kv heads)."""
    attention = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.kv_heads * cfg.d_head  # q and out; k and v
    per_layer = attention + cfg.mlp_matrices * cfg.d_model * cfg.d_ff + 2 * cfg.d_model
    return cfg.n_layers * per_layer + cfg.d_model + cfg.d_model * cfg.vocab_size


def attention_context(t: int, window: Optional[int]) -> float:
    """The context a layer's attention FLOPs count: t for a global layer (the usual 12 x d_model x t per token,
    which counts causal attention as full), and for a causal window w < t the same scaled to the scores it computes:
    a query sees w - w(w - 1) / 2t keys on average, against (t + 1) / 2 globally."""
    if window is None or window >= t:
        return float(t)
    return t * (window - window * (window - 1) / (2 * t)) / ((t + 1) / 2)


def flops_per_token(cfg: ModelConfig, context_length: Optional[int] = None) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x d_model x (each layer's attention context).

    Windows count only the scores they compute (attention_context); packed documents are counted as one sequence
    (their extent depends on the data)."""
    t = context_length or cfg.context_length
    contexts = sum(attention_context(t, cfg.layer_window(i)) for i in range(cfg.n_layers))
    return 6 * non_embedding_params(cfg) + 12 * cfg.d_model * contexts


def mfu(cfg: ModelConfig, tokens_per_s: float, device: torch.device | str, context_length: Optional[int] = None,
        n_devices: int = 1) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1], or None where the peak is unknown."""
    peak = peak_flops(device)
    if peak is None:
        return None
    return flops_per_token(cfg, context_length) * tokens_per_s / (peak * n_devices)


GIB = 1024**3


def cuda_memory_gib(device: torch.device | str) -> dict[str, float]:
    """Allocated, peak allocated and reserved memory in GiB; empty off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {
        "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
    }
