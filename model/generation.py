"""Sampling from a TransformerLM: a prefill over the prompts, then one fixed-shape decode step per token.

    decoder = Decoder(model, batch=2, max_len=256)
    logits = decoder.prefill(ids, prompt_lengths)      # (batch, vocab): the next token after each prompt
    logits = decoder.step(tokens)                      # (batch,) new tokens -> the logits after them
or all of it with `generate(model, prompts, max_new_tokens, Sampling(temperature=0.8, top_k=50))`.

The decode step reads and writes only the preallocated KVCache (model/kv_cache.py), so `compile=True` compiles it
once and, on CUDA, captures it in a CUDA graph replayed for every token. The sequence never slides past the
model's context: RoPE's tables end at context_length, and a window that slides would need the cache re-rotated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attention import graph_replay
from model.kv_cache import KVCache
from model.transformer import TransformerLM


def for_inference(model: TransformerLM, dtype: Optional[torch.dtype] = None) -> TransformerLM:
    """Eval mode, no gradients, parameters cast to `dtype` in place (the RoPE tables stay fp32)."""
    model.eval().requires_grad_(False)
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: temperature 0 is greedy (argmax).

    Otherwise, in this order (as Hugging Face's `generate`): the logits are divided by the temperature; top_k keeps
    the k most likely tokens (and any tied with the k-th); top_p keeps the smallest set of most likely tokens whose
    probabilities sum to at least top_p; the token is drawn from what is kept, renormalised.
    """

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution (..., vocab) that `sample` draws from, in fp32 (one-hot on the argmax when greedy)."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the most likely one always stays.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits (batch, vocab) -> (batch,) int64."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, sampling), 1, generator=generator).squeeze(-1)


class Decoder:
    """A model and its KVCache for `batch` sequences of up to `max_len` tokens: `prefill`, then `step` per token.

    compile: torch.compile the decode step; on CUDA it is also captured in a CUDA graph after two warm-up steps
    (the prefill, whose shape changes with the prompt, stays eager).
    """

    def __init__(self, model: TransformerLM, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                 compile: bool = False):
        param = next(model.parameters())
        self.model = model
        self.cache = KVCache(model.cfg, batch, max_len, dtype or param.dtype, param.device)
        self.compile = compile
        self._step = torch.compile(self._decode, fullgraph=True, dynamic=False) if compile else self._decode
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._warm_steps = 0
        self._tokens = torch.zeros(batch, dtype=torch.int64, device=param.device)
        self._logits: Optional[torch.Tensor] = None

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
        """ids (batch, seq) right-padded prompts, prompt_lengths (batch,) -> fp32 logits (batch, vocab) of the
        token after each prompt. Empties the cache first."""
        if ids.shape[0] != self.cache.batch or ids.shape[1] > self.max_len:
            raise ValueError(f"prompts of shape {tuple(ids.shape)} do not fit a cache of batch {self.cache.batch} "
                             f"and length {self.max_len}")
        self.cache.reset()
        logits = self.model(ids, cache=self.cache)  # (batch, seq, vocab)
        self.cache.filled = True
        lengths = prompt_lengths.to(device=ids.device, dtype=torch.int64)
        self.cache.lengths.copy_(lengths)
        return logits[torch.arange(ids.shape[0], device=ids.device), lengths - 1].float()

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, None], cache=self.cache)[:, -1].float()
        # A sequence that reached max_len stays there: later steps overwrite its last position, never past it.
        self.cache.lengths.add_(1).clamp_(max=self.max_len - 1)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch,): the newest token of each sequence -> fp32 logits (batch, vocab) of the one after it.
        The returned tensor is overwritten by the next step under a CUDA graph: read it first."""
        if not self.cache.filled:
            raise RuntimeError("Decoder.step before prefill")
        self._tokens.copy_(tokens)
        if not (self.compile and self._tokens.is_cuda):
            return self._step(self._tokens)
        if self._graph is None:
            with graph_replay():
                if self._warm_steps < 2:  # compile (and autotune) outside the capture
                    self._warm_steps += 1
                    return self._step(self._tokens)
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph):
                    self._logits = self._step(self._tokens)
        self._graph.replay()  # the capture only recorded: this step runs here
        return self._logits


@dataclass
class Generated:
    tokens: list[list[int]]  # the new tokens of each prompt
    hit_context: bool  # some sequence stopped at the model's context length before max_new_tokens


@torch.no_grad()
def generate(model: TransformerLM, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
             generator: Optional[torch.Generator] = None, stop_token: Optional[int] = None,
             on_token: Optional[Callable[[torch.Tensor], None]] = None, compile: bool = False,
             decoder: Optional[Decoder] = None) -> Generated:
    """Continue each prompt (a list of token ids) by up to max_new_tokens tokens, in one batch.

    A sequence ends at stop_token (kept in its output), at max_new_tokens, or when prompt + output fill the
    model's context. on_token gets each step's (batch,) tokens as they are drawn (rows already ended included).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    context = model.cfg.context_length
    if max(len(p) for p in prompts) > context:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens exceeds the context ({context})")
    device = next(model.parameters()).device
    budgets = [min(max_new_tokens, context - len(p)) for p in prompts]
    hit_context = any(b < max_new_tokens for b in budgets)
    # The last token drawn is never fed back: the cache holds at most prompt + budget - 1 tokens.
    max_len = max(1, max(len(p) + b - 1 for p, b in zip(prompts, budgets)), max(len(p) for p in prompts))
    if decoder is None or decoder.cache.batch != len(prompts) or decoder.max_len < max_len:
        decoder = Decoder(model, len(prompts), max_len, compile=compile)
    ids = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    logits = decoder.prefill(ids.to(device), lengths.to(device))
    out: list[list[int]] = [[] for _ in prompts]
    done = [b == 0 for b in budgets]
    for _ in range(max(budgets)):
        tokens = sample(logits, sampling, generator)
        if on_token is not None:
            on_token(tokens)
        for i, t in enumerate(tokens.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = len(out[i]) >= budgets[i] or t == stop_token
        if all(done):
            break
        logits = decoder.step(tokens)
    return Generated(out, hit_context)
