"""The Transformer LM: RMSNorm, SwiGLU, RoPE, pre-norm blocks."""

from model.config import PRESETS, ModelConfig, config_for
from model.transformer import Block, CausalSelfAttention, TransformerLM

__all__ = ["PRESETS", "ModelConfig", "config_for", "Block", "CausalSelfAttention", "TransformerLM"]
