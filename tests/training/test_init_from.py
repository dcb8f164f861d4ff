"""training/init_from.py: train.py --init-from DIR starts a run from a Hugging Face Llama directory."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
import export
import sample
import train
from model import ModelConfig
from training import cli
from training.checkpoint.inference import open_checkpoint, run_config_of
from training.config import ConfigError
from training.data.record import run_tokenizer
from training.init_from import init_config

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4)
RUN = ["--batch-size", "4", "--device", "cpu", "--wandb", "disabled", "--log-every", "1", "--eval-every", "0",
       "--eval-batches", "1"]
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n"


def foreign_tokenizer():
    """A byte-level BPE from elsewhere: its end of document is its eos token, "</s>", not ours."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, Path]:
    """A random Llama saved by transformers, with a tokenizer of 281 tokens (the model's vocabulary is 320), and
    token ids of that tokenizer in a .npy file."""
    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    tok = foreign_tokenizer()
    tok.save(str(root / "llama" / "tokenizer.json"))
    (root / "llama" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    ids = [i for _ in range(60) for i in [1, *tok.encode(TEXT).ids]]  # each document begins with </s>
    np.save(root / "tokens.npy", np.asarray(ids, dtype=np.int64))
    return root / "llama", root / "tokens.npy"


def test_the_model_comes_from_config_json_and_flags_may_only_keep_the_weights(llama_dir):
    directory, _ = llama_dir
    config, explicit = cli.parse(["--init-from", str(directory), "--context-length", "16", "--window", "8"])
    model = init_config(config, explicit).model
    assert (model.d_model, model.n_layers, model.n_heads, model.n_kv_heads, model.d_ff, model.vocab_size) == (
        32, 2, 4, 2, 64, 320)
    assert (model.context_length, model.window) == (16, 8)
    for argv, message in ((["--d-model", "64"], f"--d-model 64 differs from --init-from {directory}, whose "
                                                f"config.json has 32: the model comes from it (drop the flag)"),
                          (["--size", "tiny"], "--d-model 256 differs"),
                          (["--rope-theta", "500"], "--rope-theta 500.0 differs"),
                          (["--vocab-size", "256"], "--vocab-size 256 differs")):
        config, explicit = cli.parse(["--init-from", str(directory), *argv])
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            init_config(config, explicit)
    config, explicit = cli.parse(["--init-from", str(directory), "--resume", "--out", "/nowhere"])
    assert init_config(config, explicit) == config, "a resumed run's model is its own"


def test_a_run_starts_from_the_weights_and_records_the_tokenizer(llama_dir, tmp_path, capsys):
    directory, tokens = llama_dir
    argv = [*RUN, "--init-from", str(directory), "--data", str(tokens), "--context-length", "16", "--steps", "2",
            "--lr", "0", "--min-lr", "0", "--out", str(tmp_path / "run")]
    assert train.main(argv) == 0
    from tokenizers import Tokenizer

    n_tokens = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()  # 281: BPE ran out of pairs
    assert f"initial weights from {directory} and its tokenizer (vocabulary {n_tokens})" in capsys.readouterr().out
    path, state = open_checkpoint(tmp_path / "run")
    config = run_config_of(state)
    assert (config.model.vocab_size, config.model.context_length, config.run.init_from) == (320, 16, str(directory))
    # Learning rate 0: the weights are still the directory's, bit for bit.
    _, theirs = open_checkpoint(directory)
    assert all(torch.equal(state["model"][k], v) for k, v in theirs["model"].items())
    tokenizer = run_tokenizer(tmp_path / "run")
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (n_tokens, 1)
    assert sample.main(["--out", str(tmp_path / "run"), "--prompt", "def", "--max-new-tokens", "4",
                        "--device", "cpu", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
    # evaluate.py scores the run on its own token file, which names no tokenizer: taken as the recorded one's.
    assert evaluate.main([str(tmp_path / "run"), "--json", "--eval-batches", "1"]) == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(logged["val_loss"], rel=1e-6)

    # A resume continues from its checkpoint: --init-from (here another directory) is not read again.
    argv = [*argv[:argv.index("--steps")], "--steps", "3", "--resume", "--init-from", str(tmp_path / "nowhere"),
            "--out", str(tmp_path / "run")]
    assert train.main(argv) == 0
    assert "initial weights" not in capsys.readouterr().out
    assert open_checkpoint(tmp_path / "run")[1]["step"] == 3


def test_export_then_init_from_continues_the_same_model(llama_dir, tmp_path):
    """Round trip: a run started from a directory, exported, is a directory with the weights it ended with."""
    directory, tokens = llama_dir
    base = [*RUN, "--data", str(tokens), "--context-length", "16", "--steps", "2"]
    assert train.main([*base, "--init-from", str(directory), "--out", str(tmp_path / "a")]) == 0
    assert export.main([str(tmp_path / "a"), "--to", "hf", str(tmp_path / "a-hf")]) == 0
    _, trained = open_checkpoint(tmp_path / "a")
    _, exported = open_checkpoint(tmp_path / "a-hf")
    assert all(torch.equal(exported["model"][k], v) for k, v in trained["model"].items())
    tokenizer_json = (tmp_path / "a-hf" / "tokenizer.json").read_text()
    assert tokenizer_json == (directory / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "a-hf" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "a-hf").eos_token_id == 1


def test_data_of_another_tokenizer_or_a_directory_ours_cannot_express_is_one_line(llama_dir, tmp_path, capsys,
                                                                                   text_file):
    directory, tokens = llama_dir
    base = [*RUN, "--steps", "1", "--context-length", "16", "--out", str(tmp_path / "run")]
    assert train.main([*base, "--init-from", str(directory), "--data", str(text_file)]) == 1
    assert capsys.readouterr().err == (
        f"error: {text_file} is read as UTF-8 bytes, but the model reads tokens of --init-from {directory}'s "
        "tokenizer.json (vocabulary 281): pass its tokens as a .bin/.npy file\n")
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "biased").mkdir()
    (tmp_path / "biased" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert train.main([*base, "--init-from", str(tmp_path / "biased"), "--data", str(tokens)]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path}/biased/config.json: attention_bias true: ours is "
                                       "false\n")
    assert train.main([*base, "--init-from", str(tmp_path / "missing"), "--data", str(tokens)]) == 1
    assert "no such directory (a local Hugging Face model directory; nothing is downloaded)" in capsys.readouterr().err


def test_a_directory_without_weights_is_refused_before_the_run_starts(llama_dir, tmp_path, capsys):
    directory, tokens = llama_dir
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((directory / "config.json").read_text())
    config, explicit = cli.parse(["--init-from", str(tmp_path / "empty")])
    assert init_config(config, explicit).model == ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                                              vocab_size=320, context_length=64, n_kv_heads=2)
    assert train.main([*RUN, "--steps", "1", "--init-from", str(tmp_path / "empty"), "--data", str(tokens),
                       "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.endswith(f"error: {tmp_path}/empty holds no model.safetensors nor "
                                            "model.safetensors.index.json\n")
    assert not (tmp_path / "run" / "config.json").exists()
