"""The precision report: its dtype table matches the tensors a training step makes, and the accumulation figures
follow from the formats."""

import pytest
import torch

import bench_model
from benchmarking.precision_report import ADDEND, TIMES, accumulation_rows, dtype_rows, report
from model import ModelConfig, TransformerLM
from training.precision import autocast

CFG = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=97, context_length=32)
LOW = {"inputs of the blocks' matmuls", "output of blocks.0.attn.qkv", "output of blocks.0.attn",
       "output of blocks.0.ffn", "output of lm_head"}


def table(rows):
    return {r["tensor"]: r["dtype"] for r in rows}


RESIDUAL = {"output of blocks.0.attn_norm", "output of blocks.0.ffn_norm", "output of blocks.0",
            "output of final_norm"}


@pytest.mark.parametrize("precision, low", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_dtypes_match_the_tensors_of_a_training_step(precision, low):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**CFG))
    rows = dtype_rows(model, precision, "cpu")
    dtypes = table(rows)
    # Matmuls, the residual stream and its norms in autocast's dtype; the rest (embedding lookup, parameters, loss,
    # gradients) fp32.
    for name, dtype in dtypes.items():
        want = low if name in LOW | RESIDUAL else "float32"
        assert dtype == want, (name, dtype)
    why = {r["tensor"]: r["why"] for r in rows}["output of blocks.0"]
    assert "the residual stream: autocast's dtype" in why
    seen = []
    model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    # Against the tensors themselves, outside the report.
    ids = torch.randint(0, 97, (2, 9))
    with autocast(torch.device("cpu"), precision):
        logits = model(ids[:, :-1])
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert dtypes["output of lm_head"] == str(logits.dtype).removeprefix("torch.")
    assert dtypes["output of blocks.0"] == str(seen[0]).removeprefix("torch.")
    assert dtypes["loss"] == str(loss.dtype).removeprefix("torch.")
    grad = model.blocks[0].attn.qkv.weight.grad
    assert dtypes["gradient of blocks.0.attn.qkv.weight"] == str(grad.dtype).removeprefix("torch.")
    why = {r["tensor"]: r["why"] for r in rows}["gradient of blocks.0.attn.qkv.weight"]
    assert ("written in fp32 by its own matmul" in why) == (precision == "bf16")


def test_the_report_leaves_no_gradients_behind():
    model = TransformerLM(ModelConfig(**CFG))
    dtype_rows(model, "bf16", "cpu")
    assert all(p.grad is None for p in model.parameters())


def test_accumulation_follows_from_the_formats():
    rows = {r["dtype"]: r for r in accumulation_rows()}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        addend = float(torch.tensor(ADDEND, dtype=dtype))
        assert rows[name]["0.01 in it"] == addend
        # Into fp32 the sum is the addend's value times 1000, up to fp32 rounding.
        assert rows[name]["summed into fp32"] == pytest.approx(addend * TIMES, abs=1e-3)
    assert rows["fp32"]["summed in it"] == pytest.approx(10, abs=1e-3)
    assert rows["bf16"]["summed in it"] == 4.0  # above 4, bf16's spacing 1/32 exceeds twice 0.01
    assert 9.9 < rows["fp16"]["summed in it"] < 9.99  # above 8, each 0.01 rounds to 1/128


def test_bench_model_explain_precision_prints_both_tables(capsys):
    assert bench_model.main(["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128",
                             "--vocab-size", "97", "--dtype", "fp32,bf16", "--device", "cpu",
                             "--explain-precision"]) == []
    text = capsys.readouterr().out
    assert text.count("## Dtypes of a training step") == 2 and "--dtype bf16 on cpu" in text
    assert "| bf16 | 0.01001 | 4.000 |" in text
    assert report(TransformerLM(ModelConfig(**CFG)), "fp32", "cpu") in text


def test_under_fp8_the_blocks_matmuls_are_float8_and_the_rest_unchanged():
    pytest.importorskip("torchao.float8")
    from training import fp8

    plain, converted = TransformerLM(ModelConfig(**CFG)), TransformerLM(ModelConfig(**CFG))
    fp8.convert(converted, "tensorwise", torch.device("cpu"))
    before, after = table(dtype_rows(plain, "bf16", "cpu")), table(dtype_rows(converted, "bf16", "cpu"))
    assert after.pop("inputs of the blocks' matmuls").startswith("float8_e4m3fn")
    before.pop("inputs of the blocks' matmuls")
    assert after == before  # outputs, loss and gradients keep their dtypes
