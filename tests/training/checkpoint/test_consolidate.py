import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.ranks import single_rank_group
from training.checkpoint import consolidate, sharded
from training.checkpoint import format as checkpoint
from training.checkpoint.resume import load_checkpoint
from training.config import Config
from training.parallel.distributed import DistContext
from training.parallel.wrap import wrap_model

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=97, context_length=16)
CONFIG = Config(model=CFG).replace(execution={"attn": "naive", "parallel": "fsdp"})


def adamw(model) -> torch.optim.AdamW:
    """Two parameter groups, as train.py makes them, so the index mapping crosses a group boundary."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)


def write_sharded(tmp_path, steps: int = 2):
    """An FSDP checkpoint after `steps` steps; returns its directory, full weights and full first moments."""
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        torch.manual_seed(0)
        model = TransformerLM(CFG, "naive")
        wrap_model(model, ctx, torch.float32)
        optimizer = adamw(model)
        for _ in range(steps):
            model(torch.randint(0, CFG.vocab_size, (2, 16))).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        extras = {"step": steps, "config": CONFIG.to_dict(), "rng": checkpoint.rng_state(), "scaler": {}}
        sharded.save(path, model, optimizer, extras, ctx)
        names = {id(p): n for n, p in model.named_parameters()}
        weights = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        moments = {names[id(p)]: s["exp_avg"].full_tensor().clone() for p, s in optimizer.state.items()}
    return path, weights, moments


def test_consolidated_file_loads_into_one_process(tmp_path):
    path, weights, moments = write_sharded(tmp_path)
    consolidate.consolidate(path, tmp_path / "full.safetensors")  # no process group from here on
    loaded = checkpoint.load(tmp_path / "full.safetensors")
    assert loaded["step"] == 2 and loaded["config"] == CONFIG.to_dict()
    assert set(loaded["optimizer"]["state"]) == set(weights), "keyed by parameter name"
    assert [g["params"] for g in loaded["optimizer"]["param_groups"]] == [
        [n for n, w in weights.items() if w.dim() >= 2], [n for n, w in weights.items() if w.dim() < 2]]
    model = TransformerLM(ModelConfig.from_dict(loaded["config"]["model"]))
    model.load_state_dict(loaded["model"])  # strict: the same names
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
    optimizer = adamw(model)
    optimizer.load_state_dict(loaded["optimizer"])
    for name, p in model.named_parameters():
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], moments[name], rtol=0, atol=0)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_consolidated_file_resumes_the_run_in_one_process(tmp_path):
    """As the module says: copied to <out>/checkpoint-<step>.safetensors, `train.py --resume` continues in one
    process."""
    path, weights, moments = write_sharded(tmp_path)
    out = tmp_path / "run"
    consolidate.consolidate(path, out / "checkpoint-2.safetensors")
    model = TransformerLM(CFG, "naive")
    optimizer = adamw(model)
    one_process = CONFIG.replace(execution={"parallel": "none"})
    resumed = load_checkpoint(out, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), one_process,
                              DistContext(), warn=lambda m: pytest.fail(m))
    assert resumed.step == 2 and resumed.path == out / "checkpoint-2.safetensors"
    assert resumed.changes == ["resuming with --parallel none; the checkpoint was written with fsdp (the weights do "
                               "not depend on it)"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], moments[name], rtol=0, atol=0)


def test_cli_model_only_and_missing_directory(tmp_path, capsys):
    path, weights, _ = write_sharded(tmp_path, steps=1)
    assert consolidate.main([str(path), str(tmp_path / "w.safetensors"), "--model-only"]) == 0
    n = sum(w.numel() for w in weights.values())
    assert f"step 1, {n / 1e6:.1f}M parameters" in capsys.readouterr().out
    loaded = checkpoint.load(tmp_path / "w.safetensors")
    assert "optimizer" not in loaded and loaded["model"].keys() == weights.keys()
    assert consolidate.main([str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 1
    assert "no sharded checkpoint to resume from at" in capsys.readouterr().err


def test_help_names_the_module_to_run_and_the_keys_it_writes(capsys):
    with pytest.raises(SystemExit) as e:
        consolidate.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert (f"python -m {consolidate.__name__} runs/x/{sharded.DCP_DIR_NAME} runs/x/consolidated.safetensors"
            in text)
    assert consolidate.__name__ == "training.checkpoint.consolidate"
    assert "checkpoint-<step>.safetensors" in text and "model_config" not in text
