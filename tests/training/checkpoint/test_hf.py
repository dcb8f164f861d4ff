"""training/checkpoint/hf.py: Hugging Face Llama directories, as transformers writes them and as export.py does, opened
through training/checkpoint/inference.py like any checkpoint."""

import json

import pytest
import torch

from model import ModelConfig, TransformerLM
from model.hf_llama import to_llama
from training.checkpoint import hf
from training.checkpoint.files import CheckpointError
from training.checkpoint.inference import load_model, open_checkpoint, run_config_of
from training.config import Config
from training.data.record import data_note, run_tokenizer

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=5e5)


def saved_llama(directory, **changes):
    """A random Llama (GQA) built and saved by transformers itself: what a model directory from elsewhere holds."""
    sharded = changes.pop("sharded", False)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **changes})).eval()
    llama.save_pretrained(directory, **({"max_shard_size": "40KB"} if sharded else {}))
    return llama


def test_a_llama_from_transformers_loads_with_its_logits_and_trains_as_it_does(tmp_path):
    llama = saved_llama(tmp_path / "llama")
    path, state = open_checkpoint(tmp_path / "llama")
    assert path == tmp_path / "llama" / "model.safetensors" and state["step"] == 0
    config = run_config_of(state)
    assert config.model == ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=96, vocab_size=97, context_length=32,
                                       n_kv_heads=2, rope_theta=5e5)
    ours = load_model(path, state, config.model, "naive", CPU)
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, rtol=1e-5, atol=1e-5)

    # One training step on the same batch, with the same loss (mean next-token cross-entropy) and optimizer.
    llama.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0) for m in (ours, llama)]
    ours_loss = ours(ids[:, :-1], ids[:, 1:])
    theirs_loss = llama(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
    torch.testing.assert_close(ours_loss, theirs_loss, rtol=1e-5, atol=1e-5)
    for loss, opt in zip((ours_loss, theirs_loss), opts):
        loss.backward()
        opt.step()
    grads = to_llama({n: p.grad for n, p in ours.named_parameters()}, config.model)
    for name, p in llama.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        after = ours(ids[:, :-1], ids[:, 1:])
        torch.testing.assert_close(after, llama(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
    assert after < ours_loss


def test_sharded_safetensors_read_as_one_file(tmp_path):
    saved_llama(tmp_path / "one")
    saved_llama(tmp_path / "shards", sharded=True)
    assert len(list((tmp_path / "shards").glob("model-*-of-*.safetensors"))) > 1
    path, sharded = open_checkpoint(tmp_path / "shards")
    assert path.name == "model.safetensors.index.json"
    _, whole = open_checkpoint(tmp_path / "one")
    assert sorted(sharded["model"]) == sorted(whole["model"])
    assert all(torch.equal(sharded["model"][k], v) for k, v in whole["model"].items())


def test_what_we_write_reads_back_bit_for_bit_with_the_runs_configuration(tmp_path):
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=50, context_length=16, n_kv_heads=1)
    config = Config(model=cfg).replace(run={"eval_batches": 3, "seed": 7}, execution={"attn": "naive"})
    state = TransformerLM(cfg).state_dict()
    (tmp_path / "out").mkdir()
    written = hf.write_hf(tmp_path / "out", state, cfg, 0, None, {"step": 5, "config": config.to_dict()})
    assert sorted(p.name for p in written) == ["config.json", "generation_config.json", "model.safetensors"]
    assert hf.is_hf_dir(tmp_path / "out")
    path, back = open_checkpoint(tmp_path / "out")
    assert back["step"] == 5 and run_config_of(back) == config  # evaluate.py repeats the run's batches
    assert all(torch.equal(back["model"][k], v) for k, v in state.items())
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"bos_token_id": 0,
                                                                                      "eos_token_id": 0}


def test_a_directory_ours_cannot_express_is_one_line_naming_the_key(tmp_path):
    saved_llama(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/tied/config.json: tie_word_embeddings true: ours is "
                                              r"false$"):
        open_checkpoint(tmp_path / "tied")
    saved_llama(tmp_path / "eps", rms_norm_eps=1e-6)
    with pytest.raises(CheckpointError, match=r"config.json: rms_norm_eps 1e-06: ours is 1e-05$"):
        open_checkpoint(tmp_path / "eps")


def test_pickled_or_missing_weights_are_named(tmp_path):
    saved_llama(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").rename(tmp_path / "llama" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds no model.safetensors nor model.safetensors.index.json "
                                              r"\(pytorch_model.bin is not read: a pickle can run code"):
        open_checkpoint(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors does not load"):
        open_checkpoint(tmp_path / "llama")
    assert not hf.is_hf_dir(tmp_path) and not hf.is_hf_dir(tmp_path / "nothing")


def test_a_tokenizer_from_elsewhere_ends_documents_at_its_eos(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    saved_llama(tmp_path / "llama")
    tok.save(str(tmp_path / "llama" / "tokenizer.json"))
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    note = data_note(tmp_path / "llama")
    assert (note["tokenizer"], note["eod_token"], note["eod_id"]) == ("bpe", "</s>", 1)
    tokenizer = run_tokenizer(tmp_path / "llama")
    assert tokenizer.eod_id == 1 and tokenizer.decode(tokenizer.encode("def g(y):")) == "def g(y):"

