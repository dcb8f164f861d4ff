"""export.py: a run as a Hugging Face Llama directory that transformers loads and computes our logits with."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

import evaluate
import export
import sample
import train
from model import ModelConfig, TransformerLM
from tests.ranks import single_rank_group
from training.checkpoint import sharded
from training.checkpoint.inference import load_model, open_checkpoint, run_config_of
from training.checkpoint.resume import save_checkpoint
from training.config import Config
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.record import run_tokenizer
from training.parallel.wrap import wrap_model

transformers = pytest.importorskip("transformers")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--d-ff", "64",
        "--context-length", "32", "--batch-size", "4", "--device", "cpu", "--wandb", "disabled", "--steps", "6",
        "--log-every", "3", "--eval-every", "6", "--eval-batches", "2"]
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=64, context_length=16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A tiny GQA run of 6 steps on BPE-prepared data (vocabulary 300): what a user exports."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "corpus").mkdir()
    (root / "corpus" / "textwrap.py").write_text((STDLIB / "textwrap.py").read_text())
    prepare(resolve(str(root / "corpus")), root / "data", Settings(vocab_size=300))
    assert train.main([*TINY, "--data", str(root / "data"), "--out", str(root / "run")]) == 0
    return root / "run"


def logits_of(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(ids).logits


@pytest.mark.slow  # a run of train.py, then transformers
def test_a_bpe_run_exports_what_transformers_loads_with_our_logits_and_tokenizer(bpe_run, tmp_path, capsys):
    out = tmp_path / "llama"
    assert export.main([str(bpe_run), "--to", "hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"exported {bpe_run}/checkpoint-6.safetensors (step 6, ")
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json"])
    path, state = open_checkpoint(bpe_run)
    ours = load_model(path, state, run_config_of(state).model, "naive", CPU).eval()
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(out, ids), ours(ids), rtol=1e-5, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["eos_token_id"]) == (2, 4, 0)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    tokenizer = run_tokenizer(bpe_run)
    text = "def wrap(text, width=70):\n    return text"
    assert hf_tok(text).input_ids == tokenizer.encode(text)
    assert (hf_tok.eos_token, hf_tok.eos_token_id) == ("<|endoftext|>", tokenizer.eod_id)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == tokenizer.eod_id

    # Imported back: the same weights, bit for bit, and the run's own evaluation and samples.
    _, back = open_checkpoint(out)
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    for target in (bpe_run, out):
        assert evaluate.main([str(target), "--json", "--attn", "naive"]) == 0
    run_result, dir_result = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert dir_result["step"] == 6 and dir_result["loss"] == run_result["loss"]
    for flag, target in (("--out", bpe_run), ("--ckpt", out)):
        assert sample.main([flag, str(target), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0",
                            "--device", "cpu"]) == 0
    from_run, from_dir = capsys.readouterr().out.split("\n")[:2]
    assert from_run == from_dir and from_run.startswith("def ")


def checkpoint_of(out: Path, cfg: ModelConfig = CFG, seed: int = 0, **sections) -> TransformerLM:
    """A run directory with one checkpoint of a random model (no training needed to test the mapping)."""
    out.mkdir(exist_ok=True)
    torch.manual_seed(seed)
    model = TransformerLM(cfg, "naive")
    config = Config(model=cfg).replace(execution={"attn": "naive"}, **sections)
    save_checkpoint(out, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False),
                    1, config)
    return model.eval()


def test_a_gqa_byte_run_exports_without_a_tokenizer(tmp_path):
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=8, d_ff=64, vocab_size=256, context_length=16, n_kv_heads=2)
    model = checkpoint_of(tmp_path / "run", cfg)
    assert export.main([str(tmp_path / "run"), "--to", "hf", str(tmp_path / "llama")]) == 0
    assert sorted(p.name for p in (tmp_path / "llama").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"], config["eos_token_id"]) == (2, 8, None)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(tmp_path / "llama", ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model, data, phrase", [
    ({"window": 8, "window_pattern": "LG"}, {}, "sliding-window attention (window 8, pattern LG)"),
    ({"attn_softcap": 30.0}, {}, "attention softcap 30"),
    ({"qk_norm": True}, {}, "QK-norm"),
    ({"logit_softcap": 15.0}, {}, "logit softcap 15"),
    ({}, {"pack_documents": True}, "training on packed documents (--pack-documents: RoPE positions restarted at "
                                   "each document)"),
])
def test_what_llama_cannot_express_is_refused_unless_accepted(tmp_path, capsys, model, data, phrase):
    checkpoint_of(tmp_path / "run", ModelConfig(**{**CFG.to_dict(), **model}), data=data)
    argv = [str(tmp_path / "run"), "--to", "hf", str(tmp_path / "llama")]
    assert export.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: a Llama config cannot express this run's {phrase}: pass --accept-mismatch to export the "
                   "weights anyway (transformers will compute another function)\n")
    assert not (tmp_path / "llama").exists()
    assert export.main([*argv, "--accept-mismatch"]) == 0
    assert f"warning: exported anyway: a Llama config cannot express {phrase}" in capsys.readouterr().err
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["flash_lm"]["mismatch"] == [phrase]


def test_a_relu2_run_is_refused_even_when_mismatches_are_accepted(tmp_path, capsys):
    checkpoint_of(tmp_path / "run", ModelConfig(**{**CFG.to_dict(), "mlp": "relu2"}))
    argv = [str(tmp_path / "run"), "--to", "hf", str(tmp_path / "llama"), "--accept-mismatch"]
    assert export.main(argv) == 1
    assert capsys.readouterr().err == ("error: a Llama checkpoint cannot hold this run's relu2 MLP (Llama's is "
                                       "SwiGLU, with three matrices), not even with --accept-mismatch\n")
    assert not (tmp_path / "llama").exists()


def test_an_existing_directory_is_replaced_only_with_overwrite_and_never_half_written(tmp_path, capsys, monkeypatch):
    checkpoint_of(tmp_path / "run")
    out = tmp_path / "llama"
    out.mkdir()  # empty: taken
    argv = [str(tmp_path / "run"), "--to", "hf", str(out)]
    assert export.main(argv) == 0
    (out / "mine.txt").write_text("keep me")
    assert export.main(argv) == 1
    assert capsys.readouterr().err == f"error: {out} exists and is not empty: pass --overwrite to replace it\n"
    assert (out / "mine.txt").read_text() == "keep me"

    import safetensors.torch

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    capsys.readouterr()
    assert export.main([*argv, "--overwrite"]) == 1
    assert capsys.readouterr().err == "error: [Errno 28] No space left on device\n"
    assert (out / "mine.txt").exists(), "a failed export leaves the old directory as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "run"], "and no temporary directory"
    monkeypatch.undo()
    assert export.main([*argv, "--overwrite"]) == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "run"]

    assert export.main([str(tmp_path / "run"), "--to", "hf", str(tmp_path / "run"), "--overwrite"]) == 1
    assert "holds the checkpoint being exported" in capsys.readouterr().err


def test_a_named_checkpoint_and_an_fsdp_runs_sharded_one(tmp_path):
    older = checkpoint_of(tmp_path / "run", seed=1)
    (tmp_path / "run" / "checkpoint-1.safetensors").rename(tmp_path / "run" / "older.safetensors")
    checkpoint_of(tmp_path / "run", seed=2)
    assert export.main([str(tmp_path / "run"), "--to", "hf", str(tmp_path / "a"), "--ckpt",
                        str(tmp_path / "run" / "older.safetensors")]) == 0
    ids = torch.randint(0, CFG.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(tmp_path / "a", ids), older(ids), rtol=1e-5, atol=1e-5)

    config = Config(model=CFG).replace(execution={"attn": "naive", "parallel": "fsdp"})
    with single_rank_group() as ctx:
        torch.manual_seed(3)
        model = TransformerLM(CFG, "naive")
        wrap_model(model, ctx, torch.float32)
        optimizer = torch.optim.AdamW(model.parameters())
        sharded.save(tmp_path / "fsdp" / sharded.DCP_DIR_NAME, model, optimizer,
                     {"step": 4, "config": config.to_dict(), "scaler": {}}, ctx)
        weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    assert export.main([str(tmp_path / "fsdp"), "--to", "hf", str(tmp_path / "b")]) == 0
    _, back = open_checkpoint(tmp_path / "b")
    assert back["step"] == 4 and all(torch.equal(back["model"][k], v) for k, v in weights.items())


@pytest.mark.parametrize("argv, message", [
    (["run", "dir"], "the following arguments are required: --to"),
    (["run", "--to", "gguf", "dir"], "argument --to: invalid choice: 'gguf' (choose from hf)"),
])
def test_a_bad_flag_exits_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        export.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.replace("(choose from hf)", "") in err


def test_no_checkpoint_is_one_line(tmp_path, capsys):
    assert export.main([str(tmp_path), "--to", "hf", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: no checkpoint in {tmp_path} (train one with `python train.py --out " \
                                      f"{tmp_path}`)\n"


@pytest.mark.slow  # a run of train.py, then transformers
def test_a_byte_level_run_exports_without_a_tokenizer(tmp_path, text_file):
    """A run on text read as bytes records data.json without a tokenizer: the export writes the model alone."""
    out = tmp_path / "run"
    assert train.main(["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length",
                       "32", "--batch-size", "4", "--steps", "2", "--data", str(text_file), "--out", str(out),
                       "--wandb", "disabled", "--device", "cpu"]) == 0
    assert export.main([str(out), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]
