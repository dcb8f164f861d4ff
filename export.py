"""Export a trained model: `python export.py runs/train --to hf out/llama` writes a Hugging Face Llama directory.

It holds config.json, model.safetensors, generation_config.json and, for a run on BPE-prepared data, the tokenizer
(tokenizer.json, tokenizer_config.json, special_tokens_map.json; the end-of-document token as bos and eos), so that

    AutoModelForCausalLM.from_pretrained("out/llama"); AutoTokenizer.from_pretrained("out/llama")

load it and compute our logits. It takes the run's newest checkpoint that loads, or --ckpt FILE; an FSDP run's
sharded checkpoint is read as it is. Sliding windows, the attention and logit softcaps, QK-norm and --pack-documents
have no Llama equivalent: such a run is refused unless --accept-mismatch; one with --mlp relu2 always. The
directory appears whole or not at all; one that holds files is replaced only with --overwrite. train.py --init-from
DIR starts a run from such a directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from training.checkpoint.files import CheckpointError
from training.cli import OneLineParser
from training.data.tokenizer import TokenizerError
from training.export import ExportError, Exported, export_hf
from training.run.failures import run_main

EXPECTED = (ExportError, CheckpointError, TokenizerError, OSError)  # OSError: a full disk, a read-only directory
FORMATS = ("hf",)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a run's output directory (its newest checkpoint that loads) or a "
                                          "checkpoint file")
    p.add_argument("--to", required=True, choices=FORMATS, help="the format: hf, a Hugging Face Llama directory")
    p.add_argument("dir", type=Path, help="the directory to write")
    p.add_argument("--ckpt", type=Path, help="this checkpoint file (or sharded directory) instead of the run's "
                                             "newest; the tokenizer still comes from RUN")
    p.add_argument("--overwrite", action="store_true", help="replace DIR when it holds files")
    p.add_argument("--accept-mismatch", action="store_true",
                   help="export a run with sliding windows, a softcap, QK-norm or packed documents all the same "
                        "(noted in config.json under flash_lm.mismatch)")
    return p


def describe(done: Exported) -> str:
    names = ", ".join(f.name for f in done.files)
    return (f"exported {done.checkpoint} (step {done.step}, {done.parameters / 1e6:.2f}M parameters) to "
            f"{done.directory}: {names}\nload it with transformers: AutoModelForCausalLM.from_pretrained("
            f"{str(done.directory)!r})")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        done = export_hf(args.run, args.dir, args.ckpt, args.overwrite, args.accept_mismatch)
        print(describe(done))
        return 0

    return run_main(body, EXPECTED)


if __name__ == "__main__":
    sys.exit(main())
