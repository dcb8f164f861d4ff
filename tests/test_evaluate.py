"""evaluate.py on checkpoints of short CPU runs of train.py."""

import json
import math
import sysconfig
from pathlib import Path

import pytest

import evaluate
import train
from training.data import open_source
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.record import record_data

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--device", "cpu", "--warmup-steps", "5", "--lr", "3e-3", "--wandb", "disabled"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> tuple[Path, dict]:
    """A byte-level run on a text file; returns its output directory and its last metrics row."""
    root = tmp_path_factory.mktemp("byte_run")
    text = root / "corpus.txt"
    text.write_bytes(b"\n".join((STDLIB / name).read_bytes() for name in ("argparse.py", "textwrap.py")))
    out = root / "run"
    assert train.main([*TINY, "--data", str(text), "--out", str(out), "--steps", "12", "--eval-every", "6"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows[-1]


def run_json(capsys, *argv) -> dict:
    assert evaluate.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # the module's run (byte_run) trains
def test_evaluation_repeats_the_val_loss_the_run_logged(byte_run, capsys):
    out, last = byte_run
    result = run_json(capsys, str(out))
    assert result["step"] == 12 and result["split"] == "val"
    assert result["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result["bpb"] == result["loss"] / math.log(2), "byte-level: bits per byte are loss / ln 2"
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


@pytest.mark.slow  # the module's run (byte_run) trains
def test_full_split_and_train_split(byte_run, capsys):
    out, _ = byte_run
    full = run_json(capsys, str(out / "checkpoint-12.safetensors"), "--full")
    data = open_source(str(Path(out).parent / "corpus.txt"), 32, out.parent / ".token_cache")
    assert full["tokens"] == len(data.val) - 1
    train_split = run_json(capsys, str(out), "--split", "train", "--eval-batches", "2")
    assert train_split["tokens"] == 2 * 4 * 32
    assert evaluate.main([str(out)]) == 0
    assert "bits per byte" in capsys.readouterr().out


@pytest.mark.slow  # the module's run (byte_run) trains
def test_mismatched_data_and_missing_checkpoints_are_one_line_errors(byte_run, tmp_path, capsys):
    out, _ = byte_run
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text((STDLIB / "shlex.py").read_text())
    prepare(resolve(str(corpus)), tmp_path / "bpe", Settings(vocab_size=300))
    prepare(resolve(str(corpus)), tmp_path / "bpe2", Settings(vocab_size=280))

    def error(*argv) -> str:
        assert evaluate.main(list(argv)) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    assert "bpe holds bpe tokens, but the run in" in error(str(out), "--data", str(tmp_path / "bpe"))
    assert "no checkpoint at" in error(str(tmp_path / "nowhere.safetensors"))
    assert f"no checkpoint in {tmp_path}" in error(str(tmp_path))
    # A run that records the tokenizer it trained with refuses data from another one.
    recorded = (out / "data.json").read_bytes()
    record_data(open_source(str(tmp_path / "bpe"), 32, tmp_path), out)
    try:
        assert "is tokenized with another tokenizer (bpe, vocabulary 280)" in error(
            str(out), "--data", str(tmp_path / "bpe2"))
        assert "was trained on bpe tokens" in error(str(out))
    finally:
        (out / "data.json").write_bytes(recorded)
        (out / "tokenizer.json").unlink()


@pytest.mark.parametrize("argv, named", [([], "run"), (["runs/x", "--split", "test"], "--split"),
                                         (["runs/x", "--eval-batches", "some"], "--eval-batches"),
                                         (["runs/x", "--batch-size", "0"], "--batch-size"),
                                         (["runs/x", "--no-such-flag"], "--no-such-flag")])
def test_a_bad_flag_is_one_line_without_usage(capsys, argv, named):
    try:
        code = evaluate.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert named in captured.err and "usage" not in captured.err
