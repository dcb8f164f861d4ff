"""Turn a sharded FSDP checkpoint into one file that a single process loads.

    python -m training.checkpoint.consolidate runs/x/checkpoint_dcp runs/x/consolidated.pt [--model-only]

The file has the keys of train.py's single-process `checkpoint-<step>.pt`:
  model         TransformerLM state dict: embed.weight, blocks.<i>.attn_norm.weight, blocks.<i>.attn.qkv.weight,
                blocks.<i>.attn.out.weight, blocks.<i>.ffn_norm.weight, blocks.<i>.ffn.w1/w2/w3.weight,
                final_norm.weight, lm_head.weight (fp32, on the CPU)
  optimizer     AdamW state dict in torch.optim's own format (left out with --model-only)
  scaler, step, rng, config   as saved by the run
so `TransformerLM(ModelConfig.from_dict(ck["config"]["model"])).load_state_dict(ck["model"])` rebuilds the model, and
copying the file to `<out>/checkpoint-<step>.pt` lets `python train.py --resume --out <out>` continue in one process.
No process group is needed; memory use is the full checkpoint (weights only with --model-only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from training.checkpoint import format as checkpoint, sharded as sharded_checkpoint


def optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) in torch.optim's format (keyed by position over groups)."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: per_param for name, per_param in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def consolidate(dcp_dir: Path, out_file: Path, model_only: bool = False) -> dict[str, Any]:
    """Read every shard of `dcp_dir`, write the single-file checkpoint to `out_file` (atomically), return it."""
    full = sharded_checkpoint.load_full(dcp_dir, keys={"model"} if model_only else None)
    consolidated = {"model": full["model"], **sharded_checkpoint.load_extras(dcp_dir)}
    if not model_only:
        consolidated["optimizer"] = optimizer_state_by_index(full["optimizer"])
    checkpoint.save_atomic(consolidated, out_file)
    return consolidated


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dcp_dir", type=Path, help=f"a sharded checkpoint directory, e.g. runs/x/"
                                               f"{sharded_checkpoint.DCP_DIR_NAME}")
    p.add_argument("out_file", type=Path, help="the single-file checkpoint to write")
    p.add_argument("--model-only", action="store_true", help="weights only, no optimizer state (a third the size)")
    args = p.parse_args(argv)
    try:
        ck = consolidate(args.dcp_dir, args.out_file, args.model_only)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(t.numel() for t in ck["model"].values())
    print(f"wrote {args.out_file}: step {ck['step']}, {n / 1e6:.1f}M parameters"
          f"{'' if args.model_only else ', with optimizer state'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
