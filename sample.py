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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from attention import backend_names, why_not_decode
from model import ModelConfig, TransformerLM
from model.generation import Decoder, Sampling, for_inference, generate
from training import checkpoint_files, dataset, sharded_checkpoint
from training.precision import DTYPES


class SampleError(RuntimeError):
    """Cannot sample as asked; main() prints the one-line message and exits 1."""


class ByteTokenizer:
    """UTF-8 bytes are the tokens (train.py's text data); ids >= 256 (a model with a larger vocabulary) decode to
    nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="weights and KV cache (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--attn", help="attention backend (default: the run's, or sdpa if it has no decode path)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (and replay it as a CUDA graph on CUDA)")
    return p


def load_state(out: Path, ckpt: Optional[Path], warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """(path, checkpoint) of --ckpt, else of the run's newest checkpoint that loads."""
    if ckpt is not None:
        if not ckpt.is_file():
            raise SampleError(f"no checkpoint file {ckpt}")
        try:
            return ckpt, checkpoint_files.load_named(ckpt)
        except checkpoint_files.CheckpointError as e:
            raise SampleError(str(e)) from None
    if not out.is_dir():
        raise SampleError(f"no run at {out} (train one with `python train.py --out {out}`, or pass --ckpt FILE)")
    if not checkpoint_files.candidates(out):
        dcp = out / sharded_checkpoint.DCP_DIR_NAME
        if dcp.exists():
            raise SampleError(f"{out} holds only a sharded FSDP checkpoint; make one file of it with `python -m "
                              f"training.consolidate {dcp} {out}/consolidated.pt --model-only` and pass --ckpt")
        raise SampleError(f"no checkpoint in {out}")
    try:
        return checkpoint_files.load_newest(out, warn)
    except checkpoint_files.CheckpointError as e:
        raise SampleError(str(e)) from None


def model_config(path: Path, state: dict[str, Any]) -> ModelConfig:
    if "model_config" not in state or "model" not in state:
        raise SampleError(f"{path} is not a checkpoint of train.py (it has no model_config or model)")
    return ModelConfig(**state["model_config"])


def build_model(path: Path, state: dict[str, Any], cfg: ModelConfig) -> TransformerLM:
    """The checkpoint's model with its weights; a state dict of another shape is a SampleError."""
    model = TransformerLM(cfg)
    expected = model.state_dict()
    for name, tensor in state["model"].items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise SampleError(f"checkpoint {path} holds another model shape than its config says: {name} is "
                              f"{tuple(tensor.shape)} in the file, {tuple(expected[name].shape)} for d_model "
                              f"{cfg.d_model}, n_heads {cfg.n_heads}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}")
    missing = sorted(set(expected) - set(state["model"]))
    unexpected = sorted(set(state["model"]) - set(expected))
    if missing or unexpected:
        raise SampleError(f"checkpoint {path} holds another model shape than its config says "
                          f"({cfg.n_layers} layers): missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict(state["model"])
    return model


def pick_attention(cfg: ModelConfig, asked: Optional[str], dtype: torch.dtype, device: torch.device) -> str:
    """The backend to sample with: --attn, else the run's when it can decode here (with the model's GQA, window and
    softcap), else sdpa, else naive."""
    if asked is not None and asked not in backend_names():
        raise SampleError(f"unknown --attn {asked!r}; valid: {', '.join(backend_names())}")
    q = torch.zeros(1, cfg.n_heads, 1, cfg.d_head, dtype=dtype, device=device)
    k = torch.zeros(1, cfg.kv_heads, cfg.context_length, cfg.d_head, dtype=dtype, device=device)
    variant = {"window": cfg.window, "softcap": cfg.attn_softcap}
    name = asked or cfg.attn
    reason = why_not_decode(name, q, k, k, 1, **variant)
    if reason is None:
        return name
    for fallback in ([] if asked else ["sdpa", "naive"]):
        if why_not_decode(fallback, q, k, k, 1, **variant) is None:
            return fallback
    raise SampleError(f"attention backend {name!r} cannot decode here: {reason}")


def encode_prompt(tokenizer, text: str, cfg: ModelConfig, warn: Callable[[str], None]) -> list[int]:
    if not text:
        raise SampleError("the prompt is empty (pass --prompt TEXT)")
    ids = tokenizer.encode(text)
    outside = [(i, t) for i, t in enumerate(ids) if t >= cfg.vocab_size]
    if outside:
        i, t = outside[0]
        raise SampleError(f"the prompt's token {t} (at {i}) is outside the model's vocabulary of "
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


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        if args.max_new_tokens < 1 or args.num_samples < 1:
            raise SampleError("--max-new-tokens and --num-samples must be >= 1")
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SampleError("--device cuda, but no CUDA GPU is available (pass --device cpu)")
        precision = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
        path, state = load_state(Path(args.out), args.ckpt, say)
        cfg = model_config(path, state)
        attn = pick_attention(cfg, args.attn, DTYPES[precision], device)
        if attn != cfg.attn and args.attn is None:
            say(f"the run's attention backend {cfg.attn!r} cannot decode here; sampling with {attn!r}")
        model = build_model(path, state, replace(cfg, attn=attn))
        step = state.get("step")
        del state
        model = for_inference(model.to(device), DTYPES[precision])
        # The tokenizer of the run's prepared data (recorded beside its checkpoints); bytes for text data.
        run_tokenizer = dataset.run_tokenizer(path.parent)
        tokenizer = run_tokenizer or ByteTokenizer()
        stop_token = None if run_tokenizer is None else run_tokenizer.eod_id  # the end of a document
        prompt = encode_prompt(tokenizer, args.prompt, model.cfg, say)
    except (SampleError, ValueError, dataset.DataMismatchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    say(f"{path} (step {step}): {model.num_params() / 1e6:.1f}M parameters, attention {attn}, {precision} on "
        f"{device}")
    generator = torch.Generator(device).manual_seed(args.seed)
    budget = min(args.max_new_tokens, model.cfg.context_length - len(prompt))
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


if __name__ == "__main__":
    sys.exit(main())
