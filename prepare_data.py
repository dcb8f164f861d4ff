"""Tokenize a text corpus for training: `python prepare_data.py [INPUT] --vocab-size 8192`.

INPUT is a text file, a directory of text files, `python-packages` (the Python sources of the installed packages,
deduplicated, validation held out by whole files: hundreds of MB) or nothing: the built-in corpus (this Python's
standard library sources; `stdlib` names it too). Trains a byte-level BPE tokenizer on the training split (Hugging Face `tokenizers`, locally: no download),
encodes everything in parallel, and writes a prepared directory (training/prepared.py): train.bin, val.bin,
document starts, tokenizer.json and meta.json. Train on it with `python train.py --data DIR`. Running it again on the
same input and settings reuses the directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from training.cli import OneLineParser
from training.data.corpus import CorpusError, resolve
from training.data.prepare import Settings, prepare, remove_leftovers
from training.data.prepared import PreparedDataError
from training.data.tokenizer import BYTE_VOCAB, KINDS, TokenizerError
from training.run.directory import RunDirError, RunLock
from training.run.failures import run_main

DEFAULTS = Settings()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", help="text file or directory of text files, or a named corpus: python-packages "
                                            "(the installed packages' *.py) or stdlib; default: the built-in corpus "
                                            "(stdlib)")
    p.add_argument("--out", help="prepared directory to write; default: data/<input name>-<tokenizer>")
    p.add_argument("--tokenizer", choices=KINDS, default=DEFAULTS.tokenizer,
                   help="bpe (default): byte-level BPE trained on the input; bytes: UTF-8 bytes (vocabulary 256)")
    p.add_argument("--vocab-size", type=int, help=f"BPE vocabulary, end-of-document token included "
                                                  f"(default {DEFAULTS.vocab_size}; bytes: {BYTE_VOCAB})")
    p.add_argument("--separator", help=f"string that separates documents inside a file (default {DEFAULTS.separator}; "
                                       "python-packages: '', each file is one document)")
    p.add_argument("--val-fraction", type=float, default=DEFAULTS.val_fraction,
                   help="share of the input (its end) held out for validation (default %(default)s)")
    p.add_argument("--tokenizer-sample-bytes", type=int, default=DEFAULTS.tokenizer_sample_bytes,
                   help="train BPE on at most this many bytes, spread evenly over the training split "
                        "(default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out prepared from another input or settings")
    return p


def run(args: argparse.Namespace) -> int:
    vocab = args.vocab_size or (BYTE_VOCAB if args.tokenizer == "bytes" else DEFAULTS.vocab_size)
    Settings(args.tokenizer, vocab, val_fraction=args.val_fraction,
             tokenizer_sample_bytes=args.tokenizer_sample_bytes).check()  # the flags first, before reading any file
    corpus = resolve(args.input)
    separator = next(s for s in (args.separator, corpus.separator, DEFAULTS.separator) if s is not None)
    settings = Settings(args.tokenizer, vocab, separator, args.val_fraction, args.tokenizer_sample_bytes)
    suffix = "bytes" if args.tokenizer == "bytes" else f"bpe{vocab}"
    out = Path(args.out) if args.out else Path("data") / f"{corpus.name}-{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One preparation of --out at a time; what a killed one left goes once the lock is held.
    with RunLock(out, path=out.parent / f".{out.name}.lock"):
        for leftover in remove_leftovers(out):
            print(f"{out}: removed {leftover}, left by a preparation that was killed", file=sys.stderr)
        print(f"preparing {out} from {corpus.description} ({corpus.total_bytes / 1e6:.1f} MB)", flush=True)
        start = time.perf_counter()
        meta, reused = prepare(corpus, out, settings, args.overwrite)
    seconds = time.perf_counter() - start
    if reused:
        print(f"{out}: already prepared from the same input and settings; reused")
    else:
        n_bytes = sum(s["bytes"] for s in meta["splits"].values())
        print(f"{out}: prepared in {seconds:.1f} s ({n_bytes / 1e6 / seconds:.2f} MB/s)")
    print(f"{meta['source']}; {meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']}, {meta['dtype']}")
    for split, c in meta["splits"].items():
        print(f"  {split}: {c['tokens']:,} tokens, {c['bytes']:,} bytes ({c['bytes'] / c['tokens']:.2f} per token), "
              f"{c['documents']:,} documents")
    print(f"train on it: python train.py --data {out}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args), (CorpusError, PreparedDataError, TokenizerError, RunDirError))


if __name__ == "__main__":
    sys.exit(main())
