"""training/checkpoint/inference.py: the checkpoint sample.py and evaluate.py open, and the model they rebuild."""

from dataclasses import replace

import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.checkpoints import flip_bytes, with_nonfinite_weight, write_legacy
from training.checkpoint import files as checkpoint_files
from training.checkpoint.files import CheckpointError
from training.checkpoint.inference import load_model, open_checkpoint, run_config_of
from training.checkpoint.resume import save_checkpoint
from training.config import Config

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=64, context_length=16)
CONFIG = Config(model=CFG).replace(execution={"attn": "naive"})
CPU = torch.device("cpu")


def saved(out, step: int, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(CFG, "naive")
    save_checkpoint(out, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False),
                    step, CONFIG, keep=5)
    return model


def test_a_named_file_or_the_newest_of_a_run_directory(tmp_path):
    saved(tmp_path, 4, seed=0)
    newest = saved(tmp_path, 6, seed=1)
    path, state = open_checkpoint(tmp_path)
    assert path == tmp_path / "checkpoint-6.safetensors" and state["step"] == 6 and run_config_of(state) == CONFIG
    assert all(torch.equal(state["model"][k], v) for k, v in newest.state_dict().items())
    path, state = open_checkpoint(tmp_path / "checkpoint-4.safetensors")
    assert path == tmp_path / "checkpoint-4.safetensors" and state["step"] == 4
    del state
    # The newest that loads: a damaged one is named in a warning and the one before it opened.
    (tmp_path / "checkpoint-6.safetensors").write_bytes(b"")
    warnings = []
    path, state = open_checkpoint(tmp_path, warnings.append)
    assert path == tmp_path / "checkpoint-4.safetensors"
    assert len(warnings) == 1 and "checkpoint-6.safetensors does not load" in warnings[0]
    with pytest.raises(CheckpointError, match=rf"^checkpoint {tmp_path}/checkpoint-6.safetensors does not load: the "
                                              r"file is empty$"):
        open_checkpoint(tmp_path / "checkpoint-6.safetensors")


def test_damaged_non_finite_and_pickled_files(tmp_path):
    """A file given by name that fails its checksum, holds a non-finite weight, or is an earlier version's pickle
    without allow_pickle: one line naming it; a run directory falls back to the older one that loads."""
    saved(tmp_path, 4, seed=0)
    saved(tmp_path, 6, seed=1)
    newest = tmp_path / "checkpoint-6.safetensors"
    flip_bytes(newest, "/model/blocks.1.ffn.w2.weight")
    with pytest.raises(CheckpointError, match=rf"^checkpoint {newest} does not load: tensor "
                                              r"model/blocks.1.ffn.w2.weight does not match its checksum \(the file "
                                              r"is damaged\)$"):
        open_checkpoint(newest)
    warnings = []
    assert open_checkpoint(tmp_path, warnings.append)[0] == tmp_path / "checkpoint-4.safetensors"
    assert [w.split(" (")[0] for w in warnings] == [f"warning: checkpoint {newest} does not load"]
    saved(tmp_path, 6, seed=1)
    with_nonfinite_weight(newest, "final_norm.weight")
    with pytest.raises(CheckpointError, match=rf"^checkpoint {newest} does not load: its weights are not finite "
                                              r"\(final_norm.weight\)$"):
        open_checkpoint(newest)
    warnings = []
    assert open_checkpoint(tmp_path, warnings.append)[0] == tmp_path / "checkpoint-4.safetensors"
    assert "its weights are not finite (final_norm.weight)" in warnings[0]
    old = write_legacy(checkpoint_files.load_file(tmp_path / "checkpoint-4.safetensors"), tmp_path / "old")
    with pytest.raises(CheckpointError, match="pass --allow-pickle if you trust this file$"):
        open_checkpoint(old)
    path, state = open_checkpoint(old, allow_pickle=True)
    assert path == old and state["step"] == 4 and run_config_of(state).model == CFG


def test_no_checkpoint_is_one_line_saying_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^no checkpoint in {tmp_path} \(train one with `python train.py --out "
                                              rf"{tmp_path}`\)$"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=rf"^no checkpoint at {tmp_path}/nope.safetensors$"):
        open_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "checkpoint_dcp").mkdir()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    assert str(e.value) == (f"{tmp_path} holds only a sharded FSDP checkpoint; make one file of it with `python -m "
                            f"training.checkpoint.consolidate {tmp_path}/checkpoint_dcp "
                            f"{tmp_path}/consolidated.safetensors --model-only` and pass that file")


def test_load_model_rebuilds_the_weights(tmp_path):
    model = saved(tmp_path, 3)
    path, state = open_checkpoint(tmp_path)
    loaded = load_model(path, state, run_config_of(state).model, "sdpa", CPU)
    assert loaded.attn == "sdpa", "the backend asked for, whichever the run trained with"
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))


def test_a_state_dict_of_another_shape_is_named(tmp_path):
    saved(tmp_path, 3)
    path, state = open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as e:
        load_model(path, state, replace(CFG, d_ff=96), "naive", CPU)
    assert str(e.value) == (f"checkpoint {path} holds another model shape than its config says: blocks.0.ffn.w1.weight "
                            "is (64, 32) in the file, (96, 32) for d_model 32, n_heads 4, d_ff 96, vocab 64")
    with pytest.raises(CheckpointError) as e:
        load_model(path, state, replace(CFG, n_layers=3), "naive", CPU)
    assert str(e.value).startswith(f"checkpoint {path} holds another model shape than its config says (3 layers): "
                                   "missing ['blocks.2.attn.out.weight', ")
    with pytest.raises(CheckpointError, match=r"\(1 layers\): missing \[\], unexpected \['blocks.1.attn.out.weight', "):
        load_model(path, state, replace(CFG, n_layers=1), "naive", CPU)


def test_a_consolidated_model_only_file_opens_by_name(tmp_path):
    """What `python -m training.checkpoint.consolidate ... --model-only` writes: weights, step and config."""
    model = saved(tmp_path, 2)
    full = checkpoint_files.load_file(tmp_path / "checkpoint-2.safetensors")
    weights_only = {k: full[k] for k in ("model", "step", "config", "rng", "scaler")}
    checkpoint_files.format.save(weights_only, tmp_path / "consolidated.safetensors")
    path, state = open_checkpoint(tmp_path / "consolidated.safetensors")
    loaded = load_model(path, state, run_config_of(state).model, run_config_of(state).execution.attn, CPU)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
