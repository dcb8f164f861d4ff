"""The peer for training-step benchmarks: Hugging Face `LlamaForCausalLM` built to one of our size presets.

Llama is the same architecture (RMSNorm, SwiGLU, RoPE, pre-norm blocks, untied head), so it times what a
user would otherwise train with. `bench_model.py --impl hf` runs it through the same step, optimizer and
timing as our model, on the same tokens, in the same process. transformers is optional: only this peer
needs it, and the error says how to install it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import hf_llama
from model.config import ModelConfig


def _llama_classes():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise RuntimeError("the Hugging Face peer (--impl hf) needs transformers: "
                           "pip install transformers (or .venv/bin/pip install -e '.[peers]')") from e
    return LlamaConfig, LlamaForCausalLM


class HFLlama(nn.Module):
    """LlamaForCausalLM with our model's call signature: forward(ids) -> logits, forward(ids, targets) -> loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        LlamaConfig, LlamaForCausalLM = _llama_classes()
        self.cfg = cfg
        # The same architecture as ours (model/hf_llama.py maps the config), GQA included.
        self.hf = LlamaForCausalLM(LlamaConfig(**hf_llama.llama_config(cfg), use_cache=False,
                                               attn_implementation="sdpa"))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=ids, use_cache=False).logits  # (batch, seq, vocab)
        if targets is None:
            return logits
        # As our model and as transformers' own loss: cross-entropy on fp32 logits.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.hf.model.embed_tokens.weight.numel() if non_embedding else n


def llama_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our TransformerLM's weights under LlamaForCausalLM's names, so both compute the same function (copies: the
    mapping, with its RoPE row order, is model/hf_llama.py's)."""
    return {name: t.detach().clone() for name, t in hf_llama.to_llama(model.state_dict(), model.cfg).items()}


def llama_from(model: nn.Module) -> HFLlama:
    """HFLlama with `model`'s weights, on its device and in its dtype (the peer of sampling benchmarks)."""
    param = next(model.parameters())
    with torch.device(param.device):
        peer = HFLlama(model.cfg)
    peer.hf.load_state_dict(llama_state_dict(model))
    return peer.to(param.dtype).eval().requires_grad_(False)
