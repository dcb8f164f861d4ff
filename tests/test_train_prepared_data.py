"""train.py on prepared data (prepare_data.py), checked end to end on the CPU with a tiny model."""

import json
import math
import os
import signal
import sysconfig
from pathlib import Path

import pytest

import evaluate
import train
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.record import run_tokenizer
from training.step import TrainingStep

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--device", "cpu", "--warmup-steps", "5", "--lr", "3e-3", "--min-lr", "3e-4",
        "--wandb", "disabled"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """About 120 KB of Python source (two documents), prepared as BPE (vocabulary 512) and as bytes."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus").mkdir()
    for name in ("argparse.py", "textwrap.py"):
        (root / "corpus" / name).write_text((STDLIB / name).read_text())
    corpus = resolve(str(root / "corpus"))
    prepare(corpus, root / "bpe", Settings(vocab_size=512))
    prepare(corpus, root / "bytes", Settings(tokenizer="bytes", vocab_size=256))
    return {"bpe": root / "bpe", "bytes": root / "bytes"}


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def run(out: Path, data: Path, *extra: str) -> tuple[int, list[dict]]:
    code = train.main([*TINY, "--data", str(data), "--out", str(out), *extra])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").exists() else []
    return code, rows


@pytest.mark.slow  # two runs of 80 steps
def test_bpe_beats_bytes_in_bits_per_byte_and_evaluation_repeats_the_log(prepared, tmp_path, capsys):
    steps = ["--steps", "80", "--log-every", "40", "--eval-every", "40", "--ckpt-every", "40"]
    code, bpe = run(tmp_path / "bpe", prepared["bpe"], *steps)
    assert code == 0
    code, byte = run(tmp_path / "bytes", prepared["bytes"], *steps)
    assert code == 0
    # The same model and steps: BPE tokens carry more text per position (2.8 bytes per token here), and so reach
    # fewer bits per byte. On this corpus after 80 steps: about 3.8 against 4.6.
    assert bpe[-1]["val_bpb"] < byte[-1]["val_bpb"] - 0.3, (bpe[-1], byte[-1])
    assert byte[-1]["val_bpb"] == byte[-1]["val_loss"] / math.log(2), "bytes: bits per byte are loss / ln 2"

    # The run keeps its tokenizer; evaluate.py scores each checkpoint as the run did at that step.
    assert run_tokenizer(tmp_path / "bpe").vocab_size == 512
    capsys.readouterr()
    for target, step in ((tmp_path / "bpe", 80), (tmp_path / "bpe" / "checkpoint-40.safetensors", 40)):
        assert evaluate.main([str(target), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        logged = next(r for r in bpe if r["step"] == step)
        assert result["step"] == step
        assert result["loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
        assert result["bpb"] == pytest.approx(logged["val_bpb"], rel=1e-6)

    # Resuming on data of another tokenizer is refused, and the run keeps its tokenizer, data note and config.
    before = snapshot(tmp_path / "bpe")
    resume = [*TINY, "--data", str(prepared["bytes"]), "--out", str(tmp_path / "bpe"), "--resume", "--steps", "90"]
    assert train.main(resume) == 1
    assert capsys.readouterr().err == (
        f"error: --data {prepared['bytes']} (bytes tokens of text files under {prepared['bytes'].parent / 'corpus'} (2 "
        f"files), prepared in {prepared['bytes']}) is not the data the run in {tmp_path / 'bpe'} trained on (bpe tokens "
        f"of text files under {prepared['bpe'].parent / 'corpus'} (2 files), prepared in {prepared['bpe']}, recorded "
        f"in {tmp_path / 'bpe' / 'data.json'}); pass --data-changed to train on it anyway\n")
    assert snapshot(tmp_path / "bpe") == before
    assert train.main([*resume, "--data-changed"]) == 1  # meant, but the model is another
    assert "was written for another model: --vocab-size 512 (asked 256)" in capsys.readouterr().err
    assert snapshot(tmp_path / "bpe") == before


@pytest.mark.slow  # train.py runs and resumes
def test_packed_documents_train_and_resume_exactly(prepared, tmp_path, monkeypatch):
    args = ("--steps", "12", "--log-every", "1", "--eval-every", "0", "--ckpt-every", "100", "--pack-documents")
    code, straight = run(tmp_path / "straight", prepared["bpe"], *args)
    assert code == 0 and [r["step"] for r in straight] == list(range(1, 13))

    real_loss, calls = TrainingStep.loss, {"n": 0}

    def loss_then_interrupt(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # Ctrl-C during step 5: the run finishes that step, checkpoints, stops
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*a, **k)

    monkeypatch.setattr(TrainingStep, "loss", loss_then_interrupt)
    code, _ = run(tmp_path / "resumed", prepared["bpe"], *args)
    assert code == 130
    monkeypatch.setattr(TrainingStep, "loss", real_loss)
    code, resumed = run(tmp_path / "resumed", prepared["bpe"], *args, "--resume")
    assert code == 0 and [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_data_errors_are_one_line(prepared, tmp_path, capsys):
    def error(*argv: str) -> str:
        assert train.main([*TINY, "--steps", "10", "--out", str(tmp_path / "run"), *argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        return err

    assert "--vocab-size 1000 disagrees with the prepared data" in error("--data", str(prepared["bpe"]),
                                                                        "--vocab-size", "1000")
    assert "--pack-documents needs prepared data" in error("--pack-documents")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.bin").write_bytes(b"\0\0" * 100)
    assert "holds token files but no meta.json" in error("--data", str(broken))
