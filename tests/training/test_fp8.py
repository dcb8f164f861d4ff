"""--fp8: the blocks' Linear layers become torchao float8 ones (emulated on the CPU) sharing their weights; the loss and
gradients stay close to bf16's; the flags that cannot run are refused with the reason."""

import pytest
import torch

pytest.importorskip("torchao.float8")

import bench_model  # noqa: E402
import train  # noqa: E402
from model import ModelConfig, TransformerLM  # noqa: E402
from training import fp8  # noqa: E402
from tests.training.resolved import resolved  # noqa: E402
from training.config import ConfigError, resolve  # noqa: E402
from training.precision import autocast  # noqa: E402
from training.step import build_step  # noqa: E402

CPU = torch.device("cpu")
CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=97, context_length=32)
ATTN = "naive"


def model(cfg: ModelConfig = CFG) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(cfg, ATTN)


def test_the_blocks_linears_become_float8_sharing_their_weights():
    m = model()
    weights = {n: p for n, p in m.named_parameters()}
    swapped = fp8.convert(m, "tensorwise", CPU)
    assert swapped == [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.out", "ffn.w1", "ffn.w2",
                                                                        "ffn.w3")]
    assert type(m.blocks[0].attn.qkv).__name__ == "Float8Linear" and type(m.lm_head).__name__ == "Linear"
    assert {n: p for n, p in m.named_parameters()} == weights  # the same Parameters under the same names
    assert m.state_dict().keys() == model().state_dict().keys()  # checkpoints load into a plain model


def test_dimensions_that_are_not_multiples_of_16_stay_as_they_are():
    m = model(ModelConfig(**{**CFG.to_dict(), "d_ff": 72}))
    swapped = fp8.convert(m, "rowwise", CPU)
    assert "blocks.0.attn.qkv" in swapped and not any("ffn" in n for n in swapped)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_loss_and_gradients_stay_close_to_bf16(recipe):
    ids = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in ("bf16", recipe):
        m = model()
        if name != "bf16":
            fp8.convert(m, recipe, CPU)
        with autocast(CPU, "bf16"):
            loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results[name] = loss.item(), {n: p.grad.flatten() for n, p in m.named_parameters()}
    (loss_bf16, grads_bf16), (loss_fp8, grads_fp8) = results["bf16"], results[recipe]
    assert loss_fp8 == pytest.approx(loss_bf16, rel=1e-2)
    for name, g in grads_bf16.items():
        cosine = torch.nn.functional.cosine_similarity(g, grads_fp8[name], dim=0).item()
        assert cosine > 0.98, (name, cosine)
    assert any(not torch.equal(g, grads_fp8[n]) for n, g in grads_bf16.items())  # float8 did change something


@pytest.mark.slow  # training steps
def test_build_step_converts_before_the_optimizer_and_trains():
    m = model()
    config = resolved(CFG, execution={"attn": ATTN, "dtype": "bf16", "fp8": "tensorwise"}, data={"batch_size": 8})
    step = build_step(m, config)
    assert type(m.blocks[1].ffn.w2).__name__ == "Float8Linear"
    ids = torch.randint(0, 97, (8, 33), generator=torch.Generator().manual_seed(2))
    losses = [step(ids[:, :-1], ids[:, 1:])[0].item() for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5  # the same batch fifteen times: it learns it


@pytest.mark.parametrize("recipe, precision, d_model, message", [
    ("tensorwise", "fp32", 64, "--fp8 tensorwise trains under bf16 autocast: add --dtype bf16 (got fp32)"),
    ("rowwise", "bf16", 200, "--fp8 rowwise needs a --d-model that is a multiple of 16 (float8 matmuls), got 200"),
])
def test_what_cannot_run_is_named(recipe, precision, d_model, message):
    assert message in fp8.problem(recipe, CPU, precision, d_model)
    assert fp8.problem("off", CPU, precision, d_model) is None


def test_train_py_refuses_fp8_without_bf16(capsys):
    with pytest.raises(SystemExit) as exit:
        train.parse(["--device", "cpu", "--fp8", "rowwise"])
    assert exit.value.code == 2
    assert "add --dtype bf16 (got fp32)" in capsys.readouterr().err
    assert train.parse(["--device", "cpu", "--fp8", "rowwise", "--dtype", "bf16"]).config.execution.fp8 == "rowwise"


def test_resolve_refuses_what_fp8_cannot_run_with_the_reason():
    base = resolved(CFG, execution={"dtype": "bf16", "fp8": "rowwise"})
    assert base.execution.fp8 == "rowwise"
    assert resolve(base.replace(execution={"parallel": "fsdp"}), world_size=2).config.execution.parallel == "fsdp"
    with pytest.raises(ConfigError, match=r"multiple of 16 \(float8 matmuls\), got 200"):
        resolve(base.replace(model={"d_model": 200, "n_heads": 4}))


@pytest.mark.slow  # bench_model.py sweeps
def test_bench_model_sweeps_fp8_recipes(tmp_path):
    rows = bench_model.main(["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128", "--vocab-size",
                             "97", "--context-lengths", "32", "--batch-size", "2", "--warmup", "1", "--steps", "1",
                             "--dtype", "bf16", "--fp8", "off,tensorwise", "--mode", "train-step", "--device", "cpu",
                             "--out", str(tmp_path)])
    assert [(r["fp8"], r["status"]) for r in rows] == [("off", "ok"), ("tensorwise", "ok")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_under_fsdp_tensorwise_weights_gather_in_float8_with_scales_of_the_updated_weights(recipe):
    """Tensorwise: each float8 weight is FSDP-sharded as torchao's float8-castable tensor, and after every optimizer
    step its scale is float8's largest value over the weight's absolute maximum, the weight as updated by that step.
    Rowwise: plain weights, gathered in bf16, with nothing to precompute."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from tests.ranks import single_rank_group

    config = resolved(CFG, execution={"attn": ATTN, "dtype": "bf16", "fp8": recipe, "parallel": "fsdp"},
                      data={"batch_size": 8})
    ids = torch.randint(0, 97, (8, 33), generator=torch.Generator().manual_seed(3))
    with single_rank_group("fsdp") as ctx:
        m = model()
        step = build_step(m, config, ctx)
        layers = [mod for mod in m.modules() if type(mod).__name__ == "Float8Linear"]
        assert len(layers) == 10 and all(isinstance(layer.weight, DTensor) for layer in layers)
        castable = [isinstance(layer.weight.to_local(), WeightWithDynamicFloat8CastTensor) for layer in layers]
        assert castable == [recipe == "tensorwise"] * len(layers)
        assert (step.after_update is not None) == (recipe == "tensorwise")
        if recipe == "rowwise":
            return
        scales = []
        for _ in range(2):
            step(ids[:, :-1], ids[:, 1:])
            got = torch.stack([layer.weight._local_tensor._precomputed_scale for layer in layers])
            amax = torch.stack([layer.weight._local_tensor._tensor.double().abs().max() for layer in layers])
            want = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            scales.append(got)
        assert not torch.equal(scales[0], scales[1])  # the second step's weights have scales of their own
