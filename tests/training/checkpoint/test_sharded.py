import os

import pytest
import torch

from model import ModelConfig, TransformerLM
from tests.ranks import single_rank_group
from training.checkpoint import sharded
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


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        a, opt_a = trained_fsdp(ctx, seed=0)
        sharded.save(path, a, opt_a, {"step": 3}, ctx)
        b, opt_b = trained_fsdp(ctx, seed=1)  # other weights, other moments
        sharded.load(path, b, opt_b)
        for name, w in full_weights(a).items():
            torch.testing.assert_close(full_weights(b)[name], w, rtol=0, atol=0)
        assert sharded.load_extras(path) == {"step": 3}
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
        assert sharded.load_extras(path) == {"step": 1}
        monkeypatch.setattr(dcp, "save", real_save)
        sharded.save(path, model, optimizer, {"step": 3}, ctx)  # clears the half-written one
        assert sharded.load_extras(path) == {"step": 3}
        assert sorted(p.name for p in tmp_path.iterdir()) == [sharded.DCP_DIR_NAME]


def test_a_crash_between_the_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    path = tmp_path / sharded.DCP_DIR_NAME
    with single_rank_group() as ctx:
        model, optimizer = trained_fsdp(ctx, seed=0)
        sharded.save(path, model, optimizer, {"step": 1}, ctx)
        os.replace(path, tmp_path / f".{path.name}.old")  # the first rename happened, the second did not
        assert sharded.resolve(path) == tmp_path / f".{path.name}.old"
        assert sharded.load_extras(path) == {"step": 1}
        sharded.load(path, model, optimizer)
        sharded.save(path, model, optimizer, {"step": 2}, ctx)
        assert sharded.load_extras(path) == {"step": 2}
        assert sorted(p.name for p in tmp_path.iterdir()) == [sharded.DCP_DIR_NAME]


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint to resume from at .*nothing"):
        sharded.load_extras(tmp_path / "nothing")
