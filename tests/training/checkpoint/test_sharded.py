import collections
import os
import pickle

import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.checkpoints import MARKER, RunsCode
from tests.ranks import single_rank_group
from training.checkpoint import consolidate, sharded
from training.checkpoint import format as checkpoint
from training.checkpoint.files import CheckpointError
from training.checkpoint.format import CheckpointFormatError
from training.checkpoint.resume import load_checkpoint
from training.config import Config
from training.parallel.distributed import DistContext
from training.parallel.wrap import wrap_model

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=97, context_length=16)


def trained_fsdp(ctx, seed: int) -> tuple[TransformerLM, torch.optim.AdamW]:
    """A sharded model and an AdamW that has taken one step (so it has moments to save)."""
    torch.manual_seed(seed)
    model = TransformerLM(CFG, "naive")
    wrap_model(model, ctx, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, CFG.vocab_size, (2, 16))).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def full_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def extras_of(path) -> dict:
    """load_extras without the optimizer's hyper-parameters, which it holds beside what the run passed."""
    return {k: v for k, v in sharded.load_extras(path).items() if k != "optimizer"}


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        a, opt_a = trained_fsdp(ctx, seed=0)
        sharded.save(path, a, opt_a, {"step": 3}, ctx)
        # Tensors only in the shards; the rest in extras.safetensors, the file format of single checkpoints.
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", sharded.EXTRAS_FILE]
        assert sharded.EXTRAS_FILE == "extras.safetensors"
        metadata = sharded.read_metadata(path)
        assert all(type(m).__name__ == "TensorStorageMetadata" for m in metadata.state_dict_metadata.values())
        assert checkpoint.load(path / sharded.EXTRAS_FILE)["optimizer"]["param_groups"][0]["lr"] == 1e-2
        b, opt_b = trained_fsdp(ctx, seed=1)  # other weights, other moments
        sharded.load(path, b, opt_b)
        for name, w in full_weights(a).items():
            torch.testing.assert_close(full_weights(b)[name], w, rtol=0, atol=0)
        assert extras_of(path) == {"step": 3}
        # The moments came back too: one more identical step keeps the two models identical.
        ids = torch.randint(0, CFG.vocab_size, (2, 16))
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(ids).float().square().mean().backward()
            opt.step()
        for name, w in full_weights(a).items():
            torch.testing.assert_close(full_weights(b)[name], w, rtol=0, atol=0)


def test_a_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        model, optimizer = trained_fsdp(ctx, seed=0)
        sharded.save(path, model, optimizer, {"step": 1}, ctx)
        real_save = dcp.save

        def crash(state, checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)  # the shards are written...
            raise OSError("disk full")  # ...but the run dies before the directory is swapped in

        monkeypatch.setattr(dcp, "save", crash)
        with pytest.raises(OSError, match="disk full"):
            sharded.save(path, model, optimizer, {"step": 2}, ctx)
        assert extras_of(path) == {"step": 1}
        monkeypatch.setattr(dcp, "save", real_save)
        sharded.save(path, model, optimizer, {"step": 3}, ctx)  # clears the half-written one
        assert extras_of(path) == {"step": 3}
        assert sorted(p.name for p in tmp_path.iterdir()) == [sharded.DCP_DIR_NAME]


def test_a_crash_between_the_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        model, optimizer = trained_fsdp(ctx, seed=0)
        sharded.save(path, model, optimizer, {"step": 1}, ctx)
        os.replace(path, tmp_path / f".{path.name}.old")  # the first rename happened, the second did not
        assert sharded.resolve(path) == tmp_path / f".{path.name}.old"
        assert extras_of(path) == {"step": 1}
        sharded.load(path, model, optimizer)
        sharded.save(path, model, optimizer, {"step": 2}, ctx)
        assert extras_of(path) == {"step": 2}
        assert sorted(p.name for p in tmp_path.iterdir()) == [sharded.DCP_DIR_NAME]


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint to resume from at .*nothing"):
        sharded.load_extras(tmp_path / "nothing")


CONFIG = Config(model=CFG).replace(execution={"attn": "naive", "parallel": "fsdp"})


def saved_fsdp(tmp_path):
    """A sharded checkpoint as a run writes it: its directory, with a model and optimizer that load it."""
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        model, optimizer = trained_fsdp(ctx, seed=0)
        extras = {"step": 2, "config": CONFIG.to_dict(), "rng": checkpoint.rng_state(), "scaler": {}}
        sharded.save(path, model, optimizer, extras, ctx)
    return path


@pytest.mark.parametrize("craft", ["function", "class", "dict-of-another-class"])
def test_metadata_that_names_another_class_is_refused_and_runs_nothing(tmp_path, capsys, craft):
    """The shards' metadata is a pickle: one naming anything but DCP's own metadata classes is refused before DCP
    reads it (by the reader, the extras, a resume and consolidation), in one line, and nothing it names runs."""
    path = saved_fsdp(tmp_path)
    marker = tmp_path / MARKER
    real = pickle.loads((path / ".metadata").read_bytes())  # written here: trusted
    payload = {"function": RunsCode(marker), "class": collections.Counter("ab"),
               "dict-of-another-class": {"metadata": real, "extra": RunsCode(marker)}}[craft]
    (path / ".metadata").write_bytes(pickle.dumps(payload))
    named = {"function": "tests.checkpoints._touch", "class": "collections.Counter",
             "dict-of-another-class": "tests.checkpoints._touch"}[craft]
    message = f"{path / '.metadata'}: a sharded checkpoint's metadata may not refer to {named}"
    for read in (sharded.read_metadata, sharded.load_extras, sharded.load_full):
        with pytest.raises(CheckpointFormatError) as e:
            read(path)
        assert str(e.value) == message
    with single_rank_group() as ctx:
        model, optimizer = trained_fsdp(ctx, seed=1)
        with pytest.raises(CheckpointFormatError, match="may not refer to"):
            sharded.load(path, model, optimizer)
    model = TransformerLM(CFG, "naive")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"), CONFIG,
                        DistContext(parallel="fsdp"), lambda m: pytest.fail(m))
    assert str(e.value) == f"sharded checkpoint {path} does not load: {message}"
    assert consolidate.main([str(path), str(tmp_path / "full.safetensors")]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and "Traceback" not in captured.err
    assert not marker.exists() and not (tmp_path / "full.safetensors").exists()


def test_a_shard_of_pickled_bytes_is_refused_without_running_it(tmp_path):
    """DCP unpickles a non-tensor entry in full (torch.load without weights_only): metadata declaring one is refused,
    so a crafted directory whose shard holds a pickle runs nothing when consolidated."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / sharded.DCP_DIR_NAME
    marker = tmp_path / MARKER
    with single_rank_group() as ctx:
        model, _ = trained_fsdp(ctx, seed=0)
        dcp.save({"model": model.state_dict(), "payload": RunsCode(marker)}, checkpoint_id=str(path))
    checkpoint.save({"step": 1, "optimizer": {"state": {}, "param_groups": []}}, path / sharded.EXTRAS_FILE)
    with pytest.raises(CheckpointFormatError, match=r"may not refer to torch.distributed.checkpoint.metadata."
                                                    r"BytesStorageMetadata$"):
        consolidate.consolidate(path, tmp_path / "full.safetensors")
    assert not marker.exists()


def test_a_real_sharded_checkpoint_loads_through_the_restricted_reader_and_consolidates(tmp_path):
    path = saved_fsdp(tmp_path)
    full = sharded.load_full(path)
    assert set(full) == {"model", "optimizer"} and set(full["optimizer"]["state"]) == set(full["model"])
    consolidated = consolidate.consolidate(path, tmp_path / "full.safetensors")
    assert consolidated["step"] == 2
    assert checkpoint.load(tmp_path / "full.safetensors")["model"].keys() == full["model"].keys()
