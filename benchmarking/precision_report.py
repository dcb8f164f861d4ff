"""Mixed precision, shown on the model itself: the dtype of every tensor a training step makes, and why sums need
an fp32 accumulator.

    python bench_model.py --sizes small --dtype bf16 --explain-precision

`dtype_rows` runs one forward and backward of the model, as the training step does (training/precision.py's
autocast), and records what each part returns: parameters, the embedding, the first block's sublayers, the
residual stream, the logits, the loss and the gradients. `accumulation_rows` adds 0.01 a thousand times in each
dtype, with and without an fp32 accumulator. `report` puts both into markdown.
"""

from __future__ import annotations

from typing import Any

import torch

from model import TransformerLM
from training.config import DTYPES
from training.precision import autocast

ADDEND, TIMES = 0.01, 1000  # the accumulation experiment: 0.01 added 1000 times, 10 exactly

# What produces each recorded output, and why its dtype is what it is under autocast.
_WHY = {
    "embed": "a table lookup: the parameters' dtype (autocast casts matmul inputs, not lookups)",
    "blocks.0.attn_norm": "RMSNorm computes in fp32 and returns its input's dtype",
    "blocks.0.attn.qkv": "a matmul: autocast's dtype",
    "blocks.0.attn": "the attention kernel runs in q's dtype, then the output matmul in autocast's",
    "blocks.0.ffn_norm": "RMSNorm: its input's dtype, the residual stream's",
    "blocks.0.ffn": "the MLP's matmuls (SwiGLU's three, ReLU²'s two): autocast's dtype",
    "blocks.0": "the residual stream: autocast's dtype (the embeddings are cast once, then x + sublayer(x) adds two "
                "tensors of that dtype); fp32 without autocast",
    "final_norm": "RMSNorm: the residual stream's dtype",
    "lm_head": "the logits: a matmul, autocast's dtype",
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_rows(model: TransformerLM, precision: str, device: torch.device | str, batch: int = 2,
               seq: int = 16) -> list[dict[str, Any]]:
    """One row per tensor of a training step of `model` under `precision`: tensor, shape, dtype, why."""
    device = torch.device(device)
    seq = min(seq, model.cfg.context_length)
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    hooks = [modules[name].register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o))
             for name in _WHY]
    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), device=device)
    try:
        with autocast(device, precision):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    params = {p.dtype for p in model.parameters()}
    rows = [{"tensor": "parameters", "shape": f"{model.num_params():,} values",
             "dtype": ", ".join(sorted(_name(d) for d in params)),
             "why": "the master weights: the optimizer updates them in fp32 whatever the compute dtype"},
            _matmul_row(model, precision)]
    whys = dict(_WHY)
    rows += [{"tensor": f"output of {name}", "shape": str(tuple(t.shape)), "dtype": _name(t.dtype), "why": why}
             for name, why in whys.items() for t in [outputs[name]]]
    rows.append({"tensor": "loss", "shape": "()", "dtype": _name(loss.dtype),
                 "why": "cross-entropy of the logits cast to fp32 (a log-softmax over the vocabulary)"})
    for name in ("embed.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn_norm.weight"):
        grad = dict(model.named_parameters())[name].grad
        rows.append({"tensor": f"gradient of {name}", "shape": str(tuple(grad.shape)), "dtype": _name(grad.dtype),
                     "why": _grad_why(model, precision, name)})
    model.zero_grad(set_to_none=True)
    return rows


def _matmul_row(model: TransformerLM, precision: str) -> dict[str, Any]:
    """What the blocks' matmuls multiply: float8 under --fp8 (training/fp8.py), else autocast's dtype."""
    row = {"tensor": "inputs of the blocks' matmuls", "shape": "-"}
    if type(model.blocks[0].attn.qkv).__name__ == "Float8Linear":
        return row | {"dtype": "float8_e4m3fn; gradients float8_e5m2",
                      "why": "--fp8: torchao scales each input and weight into e4m3's range and casts it, the output "
                             "gradient into e5m2's; the products accumulate in fp32 and come out in autocast's dtype"}
    if precision == "fp32":
        return row | {"dtype": "float32", "why": "no autocast"}
    return row | {"dtype": _name(DTYPES[precision]), "why": "autocast casts each matmul's inputs; the products "
                                                            "accumulate in fp32"}


def _grad_why(model: TransformerLM, precision: str, name: str) -> str:
    if precision == "fp32":
        return "the parameter's dtype"
    if name.endswith("qkv.weight"):
        if type(dict(model.named_modules())[name.removesuffix(".weight")]).__name__ == "Float8Linear":
            return "a float8 matmul's weight gradient, returned in the parameter's fp32"
        return "written in fp32 by its own matmul (model/layers.py), not rounded to the low dtype first"
    return "autograd returns a gradient in its parameter's dtype"


def accumulation_rows() -> list[dict[str, Any]]:
    """0.01 added 1000 times in fp32, fp16 and bf16: in the dtype itself, and into an fp32 accumulator."""
    rows = []
    for name in ("fp32", "fp16", "bf16"):
        dtype = DTYPES[name]
        addend = torch.tensor(ADDEND, dtype=dtype)
        alone = torch.zeros((), dtype=dtype)
        wide = torch.zeros((), dtype=torch.float32)
        for _ in range(TIMES):
            alone += addend
            wide += addend.float()
        rows.append({"dtype": name, "0.01 in it": float(addend), "summed in it": float(alone),
                     "summed into fp32": float(wide), "exact": ADDEND * TIMES})
    return rows


def report(model: TransformerLM, precision: str, device: torch.device | str) -> str:
    """Markdown: the dtype table of a training step, and the accumulation experiment."""
    from benchmarking.report import markdown_table

    rows = dtype_rows(model, precision, device)
    sums = accumulation_rows()
    by = {r["dtype"]: r for r in sums}
    return "\n\n".join([
        f"## Dtypes of a training step, --dtype {precision} on {torch.device(device).type}",
        markdown_table(rows, ["tensor", "shape", "dtype", "why"]),
        "## Accumulation: 0.01 added 1000 times",
        markdown_table(sums, list(sums[0])),
        f"bf16 ends at {by['bf16']['summed in it']:.4g}: from 4 up its values are 1/32 apart, and 0.01 is less than "
        f"half of that, so every further addition rounds back. fp16 ends at {by['fp16']['summed in it']:.4g}: from 8 up "
        "its values are 1/128 apart, so each 0.01 adds 0.0078. Into an fp32 accumulator the same values reach 10 up "
        "to the rounding of 0.01 itself. That is why matmuls accumulate in fp32 under autocast, why the loss and the "
        "norms are computed in fp32, and why the master weights stay fp32.",
    ])
