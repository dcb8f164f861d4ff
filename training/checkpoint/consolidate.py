"""Turn a sharded FSDP checkpoint into one file that a single process loads.

    python -m training.checkpoint.consolidate runs/x/checkpoint_dcp runs/x/consolidated.safetensors [--model-only]

The file is a single-process checkpoint (training/checkpoint/format.py), with the keys of train.py's
`checkpoint-<step>.safetensors`:
  model         TransformerLM state dict: embed.weight, blocks.<i>.attn_norm.weight, blocks.<i>.attn.qkv.weight,
                blocks.<i>.attn.out.weight, blocks.<i>.ffn_norm.weight, blocks.<i>.ffn.w1/w2[/w3].weight (w3: SwiGLU),
                final_norm.weight, lm_head.weight (fp32)
  optimizer     the optimizer state keyed by parameter name (left out with --model-only)
  scaler, step, rng, config   as saved by the run
so sample.py and evaluate.py read it (--ckpt FILE), and copying it to `<out>/checkpoint-<step>.safetensors` lets
`python train.py --resume --out <out>` continue in one process. No process group is needed; memory use is the full
checkpoint (weights only with --model-only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from training.checkpoint import format, sharded
from training.cli import OneLineParser


def consolidate(dcp_dir: Path, out_file: Path, model_only: bool = False) -> dict[str, Any]:
    """Read every shard of `dcp_dir`, write the single-file checkpoint to `out_file` (atomically), return it."""
    full = sharded.load_full(dcp_dir, keys={"model"} if model_only else None)
    extras = {k: v for k, v in sharded.load_extras(dcp_dir).items() if k != "optimizer"}
    consolidated = {**extras, **full}
    format.save(consolidated, out_file)
    return consolidated


def main(argv: Optional[list[str]] = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dcp_dir", type=Path, help=f"a sharded checkpoint directory, e.g. runs/x/{sharded.DCP_DIR_NAME}")
    p.add_argument("out_file", type=Path, help="the single-file checkpoint to write")
    p.add_argument("--model-only", action="store_true", help="weights only, no optimizer state (a third the size)")
    args = p.parse_args(argv)
    try:
        ck = consolidate(args.dcp_dir, args.out_file, args.model_only)
    except (FileNotFoundError, format.CheckpointFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(t.numel() for t in ck["model"].values())
    print(f"wrote {args.out_file}: step {ck['step']}, {n / 1e6:.1f}M parameters"
          f"{'' if args.model_only else ', with optimizer state'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
