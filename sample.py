"""Sample text from a trained model: the run's newest checkpoint, streamed to the console as it is generated.

    python sample.py --out runs/train --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50 \\
        --top-p 0.95 --num-samples 3 --seed 0

Greedy with --temperature 0. The prompt is encoded with the run's tokenizer: the one of its prepared data (prepare_data.py), recorded beside the
checkpoints, or UTF-8 bytes; a sample also ends at the end-of-document token of prepared data.
A prompt longer than the model's context keeps its end (with a warning); generation stops at the context (the
window does not slide: RoPE's tables end at context_length). The decode step uses a static KV cache and the
attention backend's decode path (model/generation.py); --compile compiles it and, on CUDA, replays it as a CUDA graph.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from attention import UnknownBackendError, backend_names, why_not_decode
from model import ModelConfig
from model.generation import Decoder, Sampling, for_inference, generate
from training.checkpoint.files import CheckpointError
from training.checkpoint.inference import load_model, open_checkpoint, run_config_of
from training.cli import OneLineParser, add_field
from training.config import DTYPES, ConfigError, default_device, default_dtype, parse_device
from training.data import DataError
from training.data.record import run_tokenizer
from training.data.tokenizer import ByteTokenizer, TokenizerError
from training.run.failures import out_of_memory_message, run_main

EXPECTED = (ConfigError, CheckpointError, DataError, TokenizerError, UnknownBackendError, ValueError)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/train", help="the run's directory (default: %(default)s)")
    p.add_argument("--ckpt", type=Path, help="a checkpoint file instead of the run's newest (a consolidated FSDP "
                                             "checkpoint too)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample from the most likely tokens holding probability p")
    p.add_argument("--num-samples", type=int, default=1, help="samples, one after another")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples")
    add_field(p, "execution", "device", shown=True, dest="device")
    add_field(p, "execution", "dtype", shown=True, dest="dtype",
              help="weights and KV cache (default: bf16 on CUDA, fp32 on the CPU)")
    add_field(p, "execution", "attn", shown=True, dest="attn",
              help="attention backend (default: the run's, or sdpa if it has no decode path)")
    add_field(p, "run", "allow_pickle", shown=True, dest="allow_pickle")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (and replay it as a CUDA graph on CUDA); pays on GPUs, not "
                        "on the CPU")
    return p


def pick_attention(cfg: ModelConfig, run_attn: str, asked: Optional[str], dtype: torch.dtype,
                   device: torch.device) -> str:
    """The backend to sample with: --attn, else the run's when it can decode here (with the model's GQA, window and
    softcap), else sdpa, else naive."""
    if asked is not None and asked not in backend_names():
        raise ConfigError(f"unknown --attn {asked!r}; valid: {', '.join(backend_names())}")
    q = torch.zeros(1, cfg.n_heads, 1, cfg.d_head, dtype=dtype, device=device)
    k = torch.zeros(1, cfg.kv_heads, cfg.context_length, cfg.d_head, dtype=dtype, device=device)
    variant = {"window": cfg.window, "softcap": cfg.attn_softcap}
    name = asked or run_attn
    reason = why_not_decode(name, q, k, k, 1, **variant)
    if reason is None:
        return name
    for fallback in ([] if asked else ["sdpa", "naive"]):
        if why_not_decode(fallback, q, k, k, 1, **variant) is None:
            return fallback
    raise ConfigError(f"attention backend {name!r} cannot decode here: {reason}")


def encode_prompt(tokenizer, text: str, cfg: ModelConfig, warn: Callable[[str], None]) -> list[int]:
    if not text:
        raise ConfigError("the prompt is empty (pass --prompt TEXT)")
    ids = tokenizer.encode(text)
    outside = [(i, t) for i, t in enumerate(ids) if t >= cfg.vocab_size]
    if outside:
        i, t = outside[0]
        raise ConfigError(f"the prompt's token {t} (at {i}) is outside the model's vocabulary of "
                          f"{cfg.vocab_size} tokens")
    if len(ids) >= cfg.context_length:
        keep = cfg.context_length - 1  # room for at least one new token
        warn(f"warning: the prompt's {len(ids)} tokens do not fit the context of {cfg.context_length}; "
             f"keeping its last {keep}")
        ids = ids[-keep:]
    return ids


class Stream:
    """Prints a sample's text as its tokens arrive: the whole decode each time, printing what is new (a token may
    end inside a multi-byte character, which only the next one completes)."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, tokens: torch.Tensor) -> None:
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.write(text[self.shown:])
            self.shown = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.write(text[self.shown:])


def load(args: argparse.Namespace, say: Callable[[str], None]) -> tuple:
    """(model, tokenizer, the end-of-document id or None, the prompt's ids, a line saying what runs), all checked."""
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise ConfigError("--max-new-tokens and --num-samples must be >= 1")
    device = parse_device(args.device)
    precision = args.dtype or default_dtype(device)
    path, state = open_checkpoint(args.ckpt or Path(args.out), say, bool(args.allow_pickle))
    run = run_config_of(state)
    attn = pick_attention(run.model, run.execution.attn, args.attn, DTYPES[precision], device)
    if attn != run.execution.attn and args.attn is None:
        say(f"the run's attention backend {run.execution.attn!r} cannot decode here; sampling with {attn!r}")
    model = for_inference(load_model(path, state, run.model, attn, device), DTYPES[precision])
    # The tokenizer of the run's prepared data (recorded beside its checkpoints); bytes for text data.
    recorded = run_tokenizer(path.parent)
    tokenizer = recorded or ByteTokenizer()
    prompt = encode_prompt(tokenizer, args.prompt, model.cfg, say)
    about = (f"{path} (step {state.get('step')}): {model.num_params() / 1e6:.1f}M parameters, attention {attn}, "
             f"{precision} on {device}")
    return model, tokenizer, None if recorded is None else recorded.eod_id, prompt, about


def sample(args: argparse.Namespace) -> int:
    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    model, tokenizer, stop_token, prompt, about = load(args, say)
    say(about)
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(args.seed)
    budget = min(args.max_new_tokens, model.cfg.context_length - len(prompt))
    if args.compile:
        say("compiling the decode step (the first token waits for it)" + (
            "; on the CPU compiled decoding is no faster than eager" if device.type == "cpu" else ""))
    decoder = Decoder(model, 1, max(len(prompt), len(prompt) + budget - 1), compile=args.compile)
    for i in range(args.num_samples):
        if i:
            write("\n" + "-" * 40 + "\n")
        write(tokenizer.decode(prompt))
        stream = Stream(tokenizer, write)
        start = time.perf_counter()
        out = generate(model, [prompt], args.max_new_tokens, sampling, generator, stop_token, stream, decoder=decoder)
        stream.finish()
        seconds = time.perf_counter() - start
        write("\n")
        say(f"[{len(out.tokens[0])} tokens in {seconds:.2f} s, {len(out.tokens[0]) / seconds:.1f} tokens/s]")
        if out.hit_context:
            say(f"stopped at the model's context of {model.cfg.context_length} tokens (the window does not slide)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or default_device())
    return run_main(lambda: sample(args), EXPECTED,
                    memory=lambda e: out_of_memory_message(e, device, "this model", "--max-new-tokens, or use --dtype bf16"))


if __name__ == "__main__":
    sys.exit(main())
