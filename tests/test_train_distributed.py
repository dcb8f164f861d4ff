"""train.py on two CPU processes over gloo: DDP and FSDP train like one process on the same global batch, and
checkpoints move between one process, DDP and FSDP."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import train
from model import ModelConfig, TransformerLM
from tests.ranks import free_port, run_ranks
from training.checkpoint import consolidate
from training.checkpoint.files import checkpoint_name
from training.checkpoint import format as checkpoint
from training.checkpoint import sharded as sharded_checkpoint
from training.data import open_source
from training.data.sampling import batch_at
from training.step import TrainingStep

STEPS = 8
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "16",
        "--batch-size", "4", "--dtype", "fp32", "--device", "cpu", "--steps", str(STEPS), "--warmup-steps", "2",
        "--lr", "3e-3", "--min-lr", "3e-4", "--log-every", "1", "--eval-every", "0", "--eval-batches", "2",
        "--ckpt-every", "100", "--wandb", "disabled"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((stdlib / "argparse.py").read_bytes())
    return path


def argv(text_file: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY, "--data", str(text_file), "--out", str(out), *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(got: list[dict], want: list[dict], loss_rtol: float = 1e-5, norm_rtol: float = 1e-4) -> None:
    """Same steps and, up to float summation order, the same losses and gradient norms."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in want], rtol=loss_rtol, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=norm_rtol, atol=0)
    assert max(r["grad_norm"] for r in want) > 1.0, "clipping (--grad-clip 1) should act in these runs"


def assert_same_weights(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_ranks_exited(results, *codes) -> None:
    got = [r.exit_code for r in results]
    assert got == list(codes), "\n".join(f"rank {i} (exit {r.exit_code}):\n{r.stderr[-3000:]}"
                                         for i, r in enumerate(results))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, text_file) -> Path:
    """The reference: one process, the same global batch of 4."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert train.main(argv(text_file, out)) == 0
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, text_file) -> Path:
    """FSDP over 2 ranks, activation checkpointing on, straight through."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    results = run_ranks(argv(text_file, out, "--parallel", "fsdp", "--activation-checkpointing"), out.parent / "logs")
    assert_ranks_exited(results, 0, 0)
    return out


@pytest.mark.slow  # two processes over gloo, and one
def test_ddp_trains_like_one_process(tmp_path, text_file, one_process):
    out, prof = tmp_path / "ddp", tmp_path / "prof"
    results = run_ranks(argv(text_file, out, "--parallel", "ddp", "--profile", str(prof)), tmp_path / "logs")
    assert_ranks_exited(results, 0, 0)
    assert_same_training(rows(out), rows(one_process))
    ddp = checkpoint.load(out / f"checkpoint-{STEPS}.safetensors")
    ref = checkpoint.load(one_process / f"checkpoint-{STEPS}.safetensors")
    assert ddp["step"] == STEPS
    assert_same_weights(ddp["model"], ref["model"])
    # Each rank trains on its own half of the global batch.
    source = open_source(str(text_file), 16, tmp_path)
    global_inputs = batch_at(source.train, 4, 16, seed=0, step=0).inputs
    halves = [torch.load(tmp_path / "logs" / f"rank{r}.first_inputs.pt") for r in (0, 1)]
    assert [h.shape for h in halves] == [(2, 16), (2, 16)]
    torch.testing.assert_close(torch.cat(halves), global_inputs, rtol=0, atol=0)
    # Rank 0 alone reports; the other rank stays silent. Each writes the profile of its own steps (--profile).
    assert "ddp over 2 ranks" in results[0].stdout and f"train {STEPS}/{STEPS} steps" in results[0].stdout
    assert f"profiled steps 6-8: {prof / 'trace-rank0.json'}" in results[0].stdout  # a run too short: its last
    assert results[1].stdout == ""
    assert sorted(p.name for p in prof.iterdir()) == ["kernels-rank0.md", "kernels-rank1.md", "trace-rank0.json",
                                                      "trace-rank1.json"]


@pytest.mark.slow  # two processes over gloo
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_accumulated_micro_batches_train_like_one_process(tmp_path, text_file, one_process, parallel):
    """--grad-accum-steps 2 over 2 ranks: micro-batches of one sequence, gradients reduced after the second only."""
    out = tmp_path / parallel
    results = run_ranks(argv(text_file, out, "--parallel", parallel, "--grad-accum-steps", "2"), tmp_path / "logs")
    assert_ranks_exited(results, 0, 0)
    assert_same_training(rows(out), rows(one_process))


@pytest.mark.slow  # two processes over gloo, and one
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-bf16"])
def test_ddp_bf16_with_fp32_weight_grads_trains_like_one_process(tmp_path, text_file, optimizer):
    # Under bf16 autocast the Linears' fp32 weight gradients (model/layers.py) are what DDP all-reduces; with
    # adamw-bf16 (bf16 moments) each rank's update also rewrites its weight copies, which the next forward reads.
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    bf16 = ["--dtype", "bf16", "--optimizer", optimizer]
    assert train.main(argv(text_file, one, *bf16)) == 0
    results = run_ranks(argv(text_file, ddp, *bf16, "--parallel", "ddp"), tmp_path / "logs")
    assert_ranks_exited(results, 0, 0)
    # A rank that trained on its half alone would be off by 1-7% in loss. The gradients of a step agree to fp32
    # summation order (1e-7), but a weight that differs in its last bits can round its bf16 matmul inputs the other
    # way, and that grows over the steps: up to 1.7e-4 in loss and 1.0e-4 in gradient norm by the last step here.
    assert_same_training(rows(ddp), rows(one), loss_rtol=1e-3, norm_rtol=1e-3)


@pytest.mark.slow  # two processes over gloo, and one
def test_ddp_with_muon_trains_like_one_process(tmp_path, text_file):
    """Muon over DDP: every rank orthogonalises the same all-reduced gradients, so the ranks stay identical and
    train as one process does on the whole batch."""
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    assert train.main(argv(text_file, one, "--optimizer", "muon")) == 0
    results = run_ranks(argv(text_file, ddp, "--optimizer", "muon", "--parallel", "ddp"), tmp_path / "logs")
    assert_ranks_exited(results, 0, 0)
    # Newton-Schulz runs in bf16: gradients that differ in fp32 summation order can round apart there, by up to
    # 9e-5 in a weight after 8 steps here (weights of about 0.1; a rank on its half alone is off by far more).
    assert_same_training(rows(ddp), rows(one), loss_rtol=1e-3, norm_rtol=1e-3)
    name = checkpoint_name(STEPS)
    got, want = checkpoint.load(ddp / name)["model"], checkpoint.load(one / name)["model"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=3e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow  # two processes over gloo
def test_fsdp_trains_like_one_process_and_consolidates(tmp_path, fsdp_run, one_process, capsys):
    assert_same_training(rows(fsdp_run), rows(one_process))
    dcp_dir = fsdp_run / sharded_checkpoint.DCP_DIR_NAME
    assert sorted(p.name for p in dcp_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                         "extras.safetensors"]
    assert not list(fsdp_run.glob(".checkpoint_dcp*")), "temporary or old checkpoint left behind"

    assert consolidate.main([str(dcp_dir), str(tmp_path / "full.safetensors"), "--model-only"]) == 0
    assert f"step {STEPS}" in capsys.readouterr().out
    full = checkpoint.load(tmp_path / "full.safetensors")
    assert "optimizer" not in full
    ref = checkpoint.load(one_process / f"checkpoint-{STEPS}.safetensors")
    assert_same_weights(full["model"], ref["model"])
    model = TransformerLM(ModelConfig.from_dict(full["config"]["model"]))
    model.load_state_dict(full["model"])  # strict: the documented keys, nothing missing or extra


@pytest.mark.slow  # two processes over gloo
def test_checkpoints_move_between_one_process_and_ddp(tmp_path, text_file, one_process, monkeypatch):
    out = tmp_path / "run"
    real_loss, calls = TrainingStep.loss, {"n": 0}

    def interrupt_at_step_3(*a):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*a)

    monkeypatch.setattr(TrainingStep, "loss", interrupt_at_step_3)
    assert train.main(argv(text_file, out)) == 130
    monkeypatch.setattr(TrainingStep, "loss", real_loss)
    assert checkpoint.load(out / "checkpoint-3.safetensors")["step"] == 3

    # One process -> DDP: resume, then Ctrl-C on rank 1 alone during step 6; both ranks stop there and save.
    results = run_ranks(argv(text_file, out, "--parallel", "ddp", "--resume"), tmp_path / "logs", interrupt=(1, 3))
    assert_ranks_exited(results, 130, 130)
    assert checkpoint.load(out / "checkpoint-6.safetensors")["step"] == 6

    # DDP -> one process: finish the run. A resume takes the run's settings (its config.json says ddp now), so one
    # process is asked for.
    assert train.main(argv(text_file, out, "--resume", "--parallel", "none")) == 0
    assert_same_training(rows(out), rows(one_process))
    assert_same_weights(checkpoint.load(out / f"checkpoint-{STEPS}.safetensors")["model"],
                        checkpoint.load(one_process / f"checkpoint-{STEPS}.safetensors")["model"])


@pytest.mark.slow  # two processes over gloo
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_checkpoint(tmp_path, text_file):
    # A scheduler's SIGTERM reaching rank 1 alone (torchrun would forward it to both) during step 4: both ranks
    # finish the step, save one checkpoint of it, and exit with SIGTERM's status.
    out = tmp_path / "run"
    results = run_ranks(argv(text_file, out, "--parallel", "ddp"), tmp_path / "logs", interrupt=(1, 4, signal.SIGTERM))
    assert_ranks_exited(results, 143, 143)
    assert checkpoint.load(out / "checkpoint-4.safetensors")["step"] == 4
    assert f"stopped at step 4; resume with --resume --out {out}" in results[0].stderr
    assert results[1].stderr == ""  # rank 0 alone speaks


@pytest.mark.slow  # two processes over gloo
def test_fsdp_resumes_from_its_sharded_checkpoint(tmp_path, text_file, fsdp_run, one_process, capsys):
    out = tmp_path / "run"
    fsdp_argv = argv(text_file, out, "--parallel", "fsdp", "--activation-checkpointing")
    results = run_ranks(fsdp_argv, tmp_path / "logs1", interrupt=(1, 5))
    assert_ranks_exited(results, 130, 130)
    dcp_dir = out / sharded_checkpoint.DCP_DIR_NAME
    assert sharded_checkpoint.load_extras(dcp_dir)["step"] == 5

    # A sharded checkpoint is not read by one process; the message says how to consolidate it.
    single = tmp_path / "single"
    single.mkdir()
    shutil.copytree(dcp_dir, single / sharded_checkpoint.DCP_DIR_NAME)
    assert train.main(argv(text_file, single, "--resume")) == 1
    assert "python -m training.checkpoint.consolidate" in capsys.readouterr().err
    consolidate.consolidate(dcp_dir, single / "checkpoint-5.safetensors")
    shutil.copy(out / "metrics.jsonl", single / "metrics.jsonl")

    results = run_ranks([*fsdp_argv, "--resume"], tmp_path / "logs2")
    assert_ranks_exited(results, 0, 0)
    # The same computation as the straight FSDP run, so the very same losses.
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(fsdp_run)]

    # The consolidated step-5 checkpoint, with its optimizer state, carries on in one process.
    assert train.main(argv(text_file, single, "--resume")) == 0
    assert_same_training(rows(single), rows(one_process))
    assert_same_weights(checkpoint.load(single / f"checkpoint-{STEPS}.safetensors")["model"],
                        checkpoint.load(one_process / f"checkpoint-{STEPS}.safetensors")["model"])


@pytest.mark.slow  # two processes over gloo, and one
def test_fsdp_with_bf16_moments_trains_like_one_process_and_resumes(tmp_path, text_file):
    """--optimizer adamw-bf16 on FSDP's shards: each rank updates its half of every parameter and keeps its moments in
    bf16, sharded; stopped at step 5 and resumed from the sharded checkpoint, it trains as one process does."""
    bf16_moments = ["--optimizer", "adamw-bf16"]
    one, out = tmp_path / "one", tmp_path / "fsdp"
    assert train.main(argv(text_file, one, *bf16_moments)) == 0
    fsdp_argv = argv(text_file, out, *bf16_moments, "--parallel", "fsdp")
    assert_ranks_exited(run_ranks(fsdp_argv, tmp_path / "logs1", interrupt=(1, 5)), 130, 130)
    dcp_dir = out / sharded_checkpoint.DCP_DIR_NAME
    consolidate.consolidate(dcp_dir, tmp_path / "step5.safetensors")
    moments = checkpoint.load(tmp_path / "step5.safetensors")["optimizer"]["state"]
    assert {t.dtype for entry in moments.values() for k, t in entry.items() if k.startswith("exp_avg")} == {
        torch.bfloat16}
    assert_ranks_exited(run_ranks([*fsdp_argv, "--resume"], tmp_path / "logs2"), 0, 0)
    assert_same_training(rows(out), rows(one))
    # A moment whose fp32 value differs in its last bits between the sharded and whole sums can round to the other
    # bf16 neighbour: a few weights then move 2e-5 apart.
    final = consolidate.consolidate(dcp_dir, tmp_path / "final.safetensors", model_only=True)
    assert_same_weights(final["model"], checkpoint.load(one / f"checkpoint-{STEPS}.safetensors")["model"], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-bf16"])
def test_fsdp_trains_in_float8_like_one_process_and_resumes(tmp_path, text_file, optimizer):
    """--fp8 tensorwise over 2 FSDP ranks (weights all-gathered in float8, so each shard is wrapped in torchao's
    subclass; emulated on the CPU), stopped at step 5 and resumed from its sharded checkpoint, against one process:
    the same losses up to float8's activation scales, which each rank takes from its half of the batch (1.7e-3 apart
    at most here; a resume that lost the weights would be off by 20%). The run says how long the checkpoint took to
    write and to load."""
    pytest.importorskip("torchao.float8")
    fp8 = ["--dtype", "bf16", "--fp8", "tensorwise", "--optimizer", optimizer]
    one, out = tmp_path / "one", tmp_path / "fsdp"
    assert train.main(argv(text_file, one, *fp8)) == 0
    fsdp_argv = argv(text_file, out, *fp8, "--parallel", "fsdp")
    first = run_ranks(fsdp_argv, tmp_path / "logs1", interrupt=(1, 5))
    assert_ranks_exited(first, 130, 130)
    assert f"checkpoint of step 5 written to {out / sharded_checkpoint.DCP_DIR_NAME} in " in first[0].stdout
    resumed = run_ranks([*fsdp_argv, "--resume"], tmp_path / "logs2")
    assert_ranks_exited(resumed, 0, 0)
    assert f"resuming from {out / sharded_checkpoint.DCP_DIR_NAME} (step 5), loaded in " in resumed[0].stdout
    got, want = rows(out), rows(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-2, atol=0)


@pytest.mark.slow  # two processes over gloo
def test_a_stalled_rank_becomes_an_error_after_the_timeout(tmp_path, text_file):
    results = run_ranks(argv(text_file, tmp_path / "run", "--parallel", "ddp", "--dist-timeout", "3"),
                        tmp_path / "logs", stall=(1, 3), grace_s=2)
    assert results[0].exit_code not in (0, None), "rank 0 must fail, not wait for the stalled rank forever"
    assert "Timed out" in results[0].stderr


@pytest.mark.slow  # torchrun starts two fresh Pythons
def test_torchrun_launches_train_py(tmp_path, text_file, one_process):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*torchrun, "train.py", *argv(text_file, out, "--parallel", "ddp")], env=env,
                          cwd=Path(train.__file__).parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_training(rows(out), rows(one_process))


@pytest.mark.slow  # two torchrun agents, four fresh Pythons
@pytest.mark.parametrize("parallel, per_node", [("ddp", 2), ("fsdp", 1)])
def test_the_several_machine_launch_trains_like_one_process(tmp_path, text_file, one_process, parallel, per_node):
    """docs/distributed.md's launch on several machines, as two torchrun agents on this one: they meet at a c10d
    rendezvous, number their ranks across both, and train as one process does (DDP on 2 x 2 ranks, FSDP on 2 x 1)."""
    out = tmp_path / parallel
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test", "--rdzv-conf",
         f"is_host={int(node == 0)}", "train.py", *argv(text_file, out, "--parallel", parallel)],
        env=env, cwd=Path(train.__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()  # a no-op once it has exited
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    assert f"{parallel} over {2 * per_node} ranks" in outputs[0][0] + outputs[1][0]
    assert_same_training(rows(out), rows(one_process))


@pytest.mark.parametrize(
    "code, env, extra, message",
    [
        (2, {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         ["--parallel", "ddp"], r"--batch-size 4 \(the global batch\) is not divisible by the 3 ranks"),
        (1, {}, ["--parallel", "fsdp"], r"needs the process variables torchrun sets \(RANK, WORLD_SIZE, LOCAL_RANK, "
                                        r"MASTER_ADDR, MASTER_PORT missing\); launch with "
                                        r"`torchrun --nproc-per-node N"),
        (1, {}, ["--resume"], r"no checkpoint to resume from in .*run \(looked for "
                              r"checkpoint-<step>.safetensors\)"),
    ],
)
def test_launch_errors_name_the_problem(tmp_path, text_file, monkeypatch, capsys, code, env, extra, message):
    import re

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        status = train.main(argv(text_file, tmp_path / "run", *extra))
    except SystemExit as e:  # a flag's error
        status = e.code
    assert status == code
    assert re.search(message, capsys.readouterr().err)


def test_fsdp_rejects_fp16(tmp_path, text_file, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv(text_file, tmp_path / "run", "--parallel", "fsdp", "--dtype", "fp16"))
    assert e.value.code == 2
    assert "--parallel fsdp supports --dtype bf16 or fp32" in capsys.readouterr().err
