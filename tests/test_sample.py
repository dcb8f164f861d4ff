"""sample.py: reading a run's checkpoint, --seed, the prompt and context rules, and its one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import sample
from model import ModelConfig, TransformerLM
from tests.checkpoints import write_legacy
from training.checkpoint import files as checkpoint_files
from training.checkpoint import format as checkpoint
from training.config import Config

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=256, context_length=32)


def write_run(out: Path, cfg: ModelConfig = CFG, step: int = 7, model_cfg: ModelConfig | None = None,
              legacy: bool = False) -> Path:
    """A checkpoint as train.py writes it (the keys sample.py reads: the run's config), weights from `model_cfg` if
    given; `legacy`: as the earlier version wrote it (torch.save's pickle as checkpoint-<step>.pt, the model's config
    with its attention backend, the RNG states pickled: it loads only with --allow-pickle)."""
    torch.manual_seed(step)
    model = TransformerLM(model_cfg or cfg)
    out.mkdir(parents=True, exist_ok=True)
    if legacy:
        return write_legacy({"model": model.state_dict(), "config": Config(model=cfg).to_dict(), "step": step}, out)
    path = out / f"checkpoint-{step}.safetensors"
    checkpoint.save({"model": model.state_dict(), "config": Config(model=cfg).to_dict(), "step": step}, path)
    return path


def weights(path: Path) -> dict:
    return checkpoint_files.load_file(path, allow_pickle=True)["model"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = sample.main(["--device", "cpu", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_samples_start_with_the_prompt_and_a_seed_reproduces_them(tmp_path, capsys):
    write_run(tmp_path)
    args = ["--out", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "8", "--num-samples", "2"]
    code, first, err = run(capsys, *args, "--seed", "3")
    assert code == 0 and first.startswith("ab") and "checkpoint-7.safetensors (step 7)" in err
    assert run(capsys, *args, "--seed", "3")[1] == first
    assert run(capsys, *args, "--seed", "4")[1] != first


def test_the_newest_checkpoint_is_read(tmp_path, capsys):
    write_run(tmp_path, step=3)
    write_run(tmp_path, step=12)
    assert "checkpoint-12.safetensors (step 12)" in run(capsys, "--out", str(tmp_path), "--max-new-tokens", "1")[2]


@pytest.mark.parametrize("legacy", [pytest.param(False, marks=pytest.mark.slow), True], ids=["config", "earlier-version"])
def test_greedy_equals_the_model_argmax(tmp_path, capsys, legacy):
    path = write_run(tmp_path, legacy=legacy)
    model = TransformerLM(CFG)
    model.load_state_dict(weights(path))
    ids = list(b"xy")
    with torch.no_grad():
        for _ in range(5):
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    greedy = ["--prompt", "xy", "--temperature", "0", "--max-new-tokens", "5"]
    if legacy:  # pickled: read only with --allow-pickle
        code, out, err = run(capsys, "--ckpt", str(path), *greedy)
        assert code == 1 and out == "" and err == (f"error: checkpoint {path} does not load: written by an earlier "
                                                   "version with pickle, which can run code when loaded; pass "
                                                   "--allow-pickle if you trust this file\n")
        greedy.append("--allow-pickle")
    code, out, _ = run(capsys, "--ckpt", str(path), *greedy)
    assert code == 0 and out.rstrip("\n") == bytes(ids).decode("utf-8", errors="replace")


def test_a_long_prompt_keeps_its_end_and_generation_stops_at_the_context(tmp_path, capsys):
    write_run(tmp_path)
    code, out, err = run(capsys, "--out", str(tmp_path), "--prompt", "x" * 40 + "END", "--max-new-tokens", "50")
    assert code == 0
    assert "the prompt's 43 tokens do not fit the context of 32; keeping its last 31" in err
    assert "stopped at the model's context of 32 tokens (the window does not slide)" in err
    assert out.startswith("x" * 28 + "END")


@pytest.mark.parametrize("setup,argv,code,message", [
    (None, [], 1, "error: no checkpoint at"),
    ("empty", [], 1, "error: no checkpoint in"),
    ("run", ["--ckpt", "missing.safetensors"], 1, "error: no checkpoint at missing.safetensors"),
    ("other-shape", [], 1, "holds another model shape than its config says: embed.weight is (256, 64) in the file"),
    ("run", ["--prompt", ""], 2, "error: the prompt is empty"),
    ("small-vocab", ["--prompt", "é"], 2, "the prompt's token 195 (at 0) is outside the model's vocabulary of 100"),
    ("run", ["--attn", "nope"], 2, "error: unknown --attn 'nope'"),
    ("run", ["--max-new-tokens", "0"], 2, "error: --max-new-tokens and --num-samples must be >= 1"),
])
def test_errors_are_one_line(tmp_path, capsys, setup, argv, code, message):
    out = tmp_path / "run"
    if setup == "empty":
        out.mkdir()
    elif setup == "run":
        write_run(out)
    elif setup == "other-shape":
        write_run(out, model_cfg=dataclasses.replace(CFG, d_model=64))
    elif setup == "small-vocab":
        write_run(out, dataclasses.replace(CFG, vocab_size=100))
    status, stdout, err = run(capsys, "--out", str(out), *argv)
    assert status == code and stdout == ""
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, named", [(["--max-new-tokens", "many"], "--max-new-tokens"),
                                         (["--dtype", "fp64"], "--dtype"), (["--no-such-flag"], "--no-such-flag")])
def test_a_bad_flag_is_one_line_without_usage(capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert named in captured.err and "usage" not in captured.err


@pytest.mark.slow  # a run of train.py, then sampling
def test_a_run_on_prepared_data_samples_with_its_tokenizer(tmp_path, capsys):
    import json

    from training.data.record import DATA_NOTE
    from training.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train(["def main(): return 1\n" * 50, "class A: pass\n" * 50], vocab_size=300)
    tokenizer.save(tmp_path)
    (tmp_path / DATA_NOTE).write_text(json.dumps({  # what train.py records of prepared data
        "data": "data/prepared", "corpus": "text", "tokenizer": "bpe", "tokenizer_fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}))
    cfg = dataclasses.replace(CFG, vocab_size=tokenizer.vocab_size)
    model = TransformerLM(cfg)
    model.load_state_dict(weights(write_run(tmp_path, cfg)))
    ids = tokenizer.encode("def main")
    with torch.no_grad():
        for _ in range(5):
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
            if ids[-1] == tokenizer.eod_id:
                break
    code, out, _ = run(capsys, "--out", str(tmp_path), "--prompt", "def main", "--max-new-tokens", "5",
                       "--temperature", "0")
    assert code == 0 and out.rstrip("\n") == tokenizer.decode(ids)


@pytest.mark.slow  # a run of train.py, then sampling
def test_a_model_with_attention_variants_samples_greedily_like_its_full_forward(tmp_path, capsys):
    """GQA, local/global windows and softcap: sdpa (the run's) cannot softcap, so sampling falls back to naive."""
    cfg = dataclasses.replace(CFG, n_heads=4, n_kv_heads=2, window=3, window_pattern="LG", attn_softcap=10.0)
    path = write_run(tmp_path, cfg)
    model = TransformerLM(cfg, attn="naive")
    model.load_state_dict(weights(path))
    ids = list(b"xyz")
    with torch.no_grad():
        for _ in range(6):
            ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    code, out, err = run(capsys, "--ckpt", str(path), "--prompt", "xyz", "--temperature", "0", "--max-new-tokens",
                         "6")
    assert code == 0 and out.rstrip("\n") == bytes(ids).decode("utf-8", errors="replace")
    assert "sampling with 'naive'" in err
    code, _, err = run(capsys, "--ckpt", str(path), "--attn", "sdpa", "--max-new-tokens", "1")
    assert code == 2 and "does not run logit soft-capping" in err
