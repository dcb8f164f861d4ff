import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model import ModelConfig, TransformerLM
from tests.ranks import single_rank_group, start_ranks
from training.parallel import distributed
from training.parallel.distributed import DistContext, DistributedError
from training.parallel.wrap import free_gathered_weights, wrap_model

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=97, context_length=16)
ATTN = "naive"


def test_launch_env_reads_torchrun_variables_or_names_the_launcher():
    assert distributed.launch_env("ddp", TORCHRUN) == (1, 2, 1)
    with pytest.raises(DistributedError, match=r"\(LOCAL_RANK, MASTER_PORT missing\); launch with `torchrun "
                                               r"--nproc-per-node N train.py --parallel fsdp"):
        distributed.launch_env("fsdp", {k: v for k, v in TORCHRUN.items() if k not in ("LOCAL_RANK", "MASTER_PORT")})
    with pytest.raises(DistributedError, match="RANK 2 is outside 0..WORLD_SIZE-1"):
        distributed.launch_env("ddp", {**TORCHRUN, "RANK": "2"})


def test_each_rank_drives_the_gpu_of_its_local_rank():
    assert distributed.local_device("cuda", "ddp", TORCHRUN) == torch.device("cuda", 1)
    assert distributed.local_device("cuda", "none", TORCHRUN) == torch.device("cuda")
    assert distributed.local_device("cpu", "fsdp", TORCHRUN) == torch.device("cpu")


def test_backend_follows_the_device_and_missing_pieces_are_named(monkeypatch):
    assert distributed.check_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DistributedError, match="no CUDA GPU is visible; use --device cpu to run the ranks on the CPU"):
        distributed.check_backend(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(DistributedError, match=r"NCCL is not available .* use --device cpu \(gloo backend\) or "
                                               "install a CUDA build"):
        distributed.check_backend(torch.device("cuda", 0))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.check_backend(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(DistributedError, match="LOCAL_RANK 2 has no GPU: only 2 visible"):
        distributed.check_backend(torch.device("cuda", 2))
    with pytest.raises(DistributedError, match="not 'meta'"):
        distributed.check_backend(torch.device("meta"))


def test_init_without_torchrun_names_the_launcher_and_joins_no_group(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedError, match=r"launch with `torchrun --nproc-per-node N bench_model.py --parallel "
                                               r"ddp"):
        distributed.init("ddp", "cpu", timeout_s=5, script="bench_model.py")
    assert not dist.is_initialized()
    alone = distributed.init("none", "cpu", timeout_s=5)
    assert alone == DistContext(device=torch.device("cpu")) and not alone.is_distributed and alone.is_main


@pytest.mark.parametrize("dtype, compute", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_fsdp_keeps_fp32_master_weights_computes_in_the_run_dtype_and_reduces_in_fp32(dtype, compute):
    from torch.distributed.tensor import DTensor

    with single_rank_group("fsdp") as ctx:
        torch.manual_seed(0)
        model = TransformerLM(TINY, ATTN)
        wrapped = wrap_model(model, ctx, dtype)
        seen = {}

        def record(name):
            def hook(module, args):
                seen[name] = module.weight.dtype  # the weight the matmul will use
            return hook

        model.blocks[1].ffn.w2.register_forward_pre_hook(record("w2"))
        model.lm_head.register_forward_pre_hook(record("head"))
        wrapped(torch.randint(0, TINY.vocab_size, (2, 16))).float().square().mean().backward()
        assert seen == {"w2": compute, "head": compute}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.float32, name
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        # The gradient reduce-scatter dtype is not observable with one rank; read it from FSDP's state.
        group = model.blocks[0]._get_fsdp_state()._fsdp_param_group
        assert {fp.reduce_dtype for fp in group.fsdp_params} <= {torch.float32, None}
        assert group.mp_policy.reduce_dtype in ((torch.float32,) if dtype == torch.bfloat16 else (None,))


@pytest.mark.parametrize("n_layers", [1, 3])
def test_fsdp_keeps_the_last_block_and_the_root_gathered_for_the_backward(n_layers):
    """After a forward, the blocks are their shards again but for the last, whose weights (with the root's: embedding,
    final norm, LM head) the backward needs first; after the backward, and after an evaluation's forward once
    free_gathered_weights ran, every parameter is its shard."""
    from torch.distributed.tensor import DTensor

    def gathered(model):
        return sorted({name.split(".")[0] + (f".{name.split('.')[1]}" if name.startswith("blocks.") else "")
                       for name, p in model.named_parameters() if not isinstance(p, DTensor)})

    with single_rank_group("fsdp") as ctx:
        model = TransformerLM(ModelConfig(**{**TINY.to_dict(), "n_layers": n_layers}), ATTN)
        wrap_model(model, ctx, torch.bfloat16)
        ids = torch.randint(0, TINY.vocab_size, (2, 16))
        loss = model(ids, ids)
        assert gathered(model) == sorted(["embed", "final_norm", "lm_head", f"blocks.{n_layers - 1}"])
        loss.backward()
        assert gathered(model) == []
        with torch.no_grad():
            model(ids, ids)
        assert gathered(model) != []
        free_gathered_weights(model)
        assert gathered(model) == []


def test_one_process_trains_the_model_itself():
    model = TransformerLM(TINY, ATTN)
    assert wrap_model(model, DistContext(), torch.float32) is model
    with pytest.raises(ValueError, match="unknown parallel mode 'tp'"):
        wrap_model(model, DistContext("tp"), torch.float32)


@pytest.mark.parametrize("variant", [{}, {"n_kv_heads": 1, "window": 8, "window_pattern": "LG", "qk_norm": True}])
def test_ddp_syncs_no_buffers_because_the_only_ones_are_ropes_tables(variant):
    """wrap_model turns DDP's buffer sync off: right while every buffer is computed alike on every rank."""
    model = TransformerLM(dataclasses.replace(TINY, **variant), ATTN)
    assert {name.rsplit(".", 1)[-1] for name, _ in model.named_buffers()} == {"cos", "sin"}
    with single_rank_group("ddp") as ctx:
        ddp = wrap_model(model, ctx, torch.float32)
    assert not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))


def _collectives(rank: int, marker: str) -> int:
    ctx = distributed.init("ddp", "cpu", timeout_s=20)
    try:
        assert distributed.mean_over_ranks(torch.tensor(rank + 1.0), ctx) == 1.5
        assert distributed.max_over_ranks({"a": float(rank), "b": -float(rank)}, ctx) == {"a": 1.0, "b": 0.0}
        assert distributed.any_rank(rank == 1, ctx) is True
        assert distributed.any_rank(False, ctx) is False
        with distributed.main_first(ctx):
            if ctx.is_main:
                time.sleep(0.5)  # rank 1 would get here first without the ordering
                Path(marker).write_text("built by rank 0")
            else:
                assert Path(marker).read_text() == "built by rank 0"
    finally:
        distributed.shutdown(ctx)
    return 0


def test_collectives_agree_over_two_ranks(tmp_path):
    results = start_ranks(_collectives, (str(tmp_path / "cache"),), tmp_path / "logs")
    assert [r.exit_code for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
