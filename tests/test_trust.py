"""Trusting a run: what train.py, evaluate.py and sample.py refuse, and how, on the CPU with a tiny model.

Non-finite weights never reach a checkpoint; a checkpoint runs no code when read (pickles only with --allow-pickle)
and is checked against its checksums; every refusal is checked before anything changes; a run records what it
trained on and is held to it; running out of memory names the flags that lower it. Each failure is one line and
exit status 1 (2 for a flag), without a traceback.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sysconfig
from pathlib import Path

import pytest

import evaluate
import sample
import train
from model import TransformerLM
from tests.checkpoints import MARKER, crafted_pickle, flip_bytes, with_nonfinite_weight, write_legacy
from training.checkpoint import files as checkpoint_files
from training.data.corpus import resolve
from training.data.prepare import Settings, prepare
from training.data.record import DATA_NOTE
from training.run.directory import RunLock
from training.step import TrainingStep

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--device", "cpu", "--warmup-steps", "0", "--lr", "3e-3", "--min-lr", "3e-4",
        "--wandb", "disabled", "--eval-every", "0", "--eval-batches", "1"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def call(script, argv: list[str], capsys) -> tuple[int, str, str]:
    """script.main(argv): (exit status, stdout, stderr); a flag's error exits through SystemExit with 2."""
    try:
        code = script.main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(err: str, warnings: int = 0) -> str:
    """The error line of a failure: the last line on stderr, after `warnings` one-line warnings, no traceback."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == warnings + 1 and lines[-1].startswith("error: "), err
    assert all(line.startswith("warning: ") for line in lines[:-1]), err
    return lines[-1]


def tree(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file and directory under `directory` (hidden ones too): its size and a hash of its content."""
    return {str(p.relative_to(directory)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file() else (0, "dir") for p in sorted(directory.rglob("*"))}


def training(text: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY, "--data", str(text), "--out", str(out), *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(b"\n".join((STDLIB / name).read_bytes() for name in ("argparse.py", "textwrap.py")))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus) -> Path:
    """A run of 3 steps with a checkpoint at each. Tests that change it work on a copy (`run` below)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train.main(training(corpus, out, "--steps", "3", "--ckpt-every", "1", "--keep-checkpoints", "3")) == 0
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, Path]:
    """Two prepared BPE directories of one vocabulary size (300) from two corpora: two tokenizers."""
    root = tmp_path_factory.mktemp("bpe")
    dirs = []
    for name, source in (("one", "argparse.py"), ("two", "shlex.py")):
        (root / f"{name}.txt").write_text((STDLIB / source).read_text())
        prepare(resolve(str(root / f"{name}.txt")), root / f"bpe-{name}", Settings(vocab_size=300))
        dirs.append(root / f"bpe-{name}")
    return dirs[0], dirs[1]


# --------------------------------------------------------------------------- 1. non-finite state never checkpointed


def nan_weight_after_step(monkeypatch, step: int) -> None:
    """A step that writes NaN into a weight after step `step` (its loss and gradient norm still finite)."""
    real, calls = TrainingStep.__call__, {"n": 0}

    def diverging(self, *a, **k):
        result = real(self, *a, **k)
        calls["n"] += 1
        if calls["n"] == step:
            self.model.blocks[1].ffn.w2.weight.data[0, 0] = float("nan")
        return result

    monkeypatch.setattr(TrainingStep, "__call__", diverging)


@pytest.mark.parametrize("how", [pytest.param("nan-weight", marks=pytest.mark.slow), "lr-1e6"])
def test_a_diverging_run_stops_naming_the_step_and_the_newest_finite_checkpoint(tmp_path, corpus, capsys,
                                                                                monkeypatch, how):
    out = tmp_path / "run"
    flags = ["--steps", "12", "--keep-checkpoints", "2", "--ckpt-every", "1", "--log-every", "1", "--min-lr", "0"]
    if how == "nan-weight":
        nan_weight_after_step(monkeypatch, 5)
    code, _, err = call(train, training(corpus, out, *flags, *(["--lr", "1e6"] if how == "lr-1e6" else [])), capsys)
    assert code == 1
    line = one_error(err)
    m = re.fullmatch(r"error: (loss|the gradient norm|the weights) became (nan|inf|-inf|non-finite) at step (\d+)"
                     r"(?: \((.+)\))?; stopping(?: without a checkpoint of this step)?\. Last good checkpoint: "
                     r"(\S+) \(step (\d+)\)", line)
    assert m, line
    step, newest, newest_step = int(m.group(3)), Path(m.group(5)), int(m.group(6))
    if how == "nan-weight":
        assert m.group(1, 2, 4) == ("the weights", "non-finite", "blocks.1.ffn.w2.weight") and step == 5
    assert newest == out / f"checkpoint-{step - 1}.safetensors" and newest_step == step - 1
    on_disk = checkpoint_files.numbered(out)
    assert [s for s, _ in on_disk] == [s for s in (step - 1, step - 2) if s > 0]  # none of the diverged step
    for s, path in on_disk:
        state = checkpoint_files.load_file(path)  # checks that its weights are finite
        assert state["step"] == s
    # It resumes from there: without the injected NaN, to the end; after --lr 1e6 its weights, finite but huge,
    # diverge again at once, and the run stops as before.
    monkeypatch.undo()
    code, out_text, err = call(train, training(corpus, out, *flags, "--lr", "3e-3", "--resume"), capsys)
    assert f"resuming from {newest} (step {step - 1})" in out_text
    if how == "nan-weight":
        assert code == 0 and "Traceback" not in err, err
        assert [r["step"] for r in rows(out)] == list(range(1, 13))
    else:
        assert code == 1 and one_error(err).endswith(f"Last good checkpoint: {newest} (step {step - 1})")


def test_loaders_meeting_non_finite_weights_say_so_in_one_line(run, capsys):
    newest = run / "checkpoint-3.safetensors"
    with_nonfinite_weight(newest, "final_norm.weight")
    expected = f"error: checkpoint {newest} does not load: its weights are not finite (final_norm.weight)"
    code, out, err = call(evaluate, [str(newest), "--device", "cpu"], capsys)
    assert code == 1 and out == "" and one_error(err) == expected
    code, out, err = call(sample, ["--ckpt", str(newest), "--device", "cpu", "--max-new-tokens", "2"], capsys)
    assert code == 1 and out == "" and one_error(err) == expected
    # A resume falls back to the newest that is finite, with a one-line warning.
    code, out, err = call(train, ["--resume", "--out", str(run), "--steps", "4"], capsys)
    assert code == 0 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: checkpoint {newest} does not load (its weights are not finite (final_norm.weight)); trying an "
        "older one"]
    assert f"resuming from {run / 'checkpoint-2.safetensors'} (step 2)" in out
    # evaluate.py and sample.py on the run directory take the newest that loads, alike.
    assert call(evaluate, [str(run), "--device", "cpu", "--json"], capsys)[0] == 0


# ------------------------------------------------------------------------------------------------ 2. safe format


def crafted_run(tmp_path) -> tuple[Path, Path, Path]:
    """A run directory whose only checkpoint is a crafted `checkpoint-3.pt`: (directory, file, marker)."""
    out, marker = tmp_path / "crafted", tmp_path / MARKER
    out.mkdir()
    return out, crafted_pickle(out / "checkpoint-3.pt", marker), marker


def test_a_crafted_pickle_runs_nothing_and_names_allow_pickle(tmp_path, corpus, capsys):
    out, path, marker = crafted_run(tmp_path)
    named = (f"error: checkpoint {path} does not load: written by an earlier version with pickle, which can run code "
             "when loaded; pass --allow-pickle if you trust this file")
    in_dir = (f"error: no checkpoint in {out} loads: checkpoint-3.pt (written by an earlier version with pickle, which "
              "can run code when loaded; pass --allow-pickle if you trust this file)")
    for script, argv, expected in (
            (evaluate, [str(path), "--device", "cpu"], named),
            (evaluate, [str(out), "--device", "cpu"], in_dir),
            (sample, ["--ckpt", str(path), "--device", "cpu"], named),
            (sample, ["--out", str(out), "--device", "cpu"], in_dir),
    ):
        code, stdout, err = call(script, argv, capsys)
        assert code == 1 and stdout == "" and one_error(err) == expected
        assert not marker.exists()
    before = tree(out)
    code, _, err = call(train, training(corpus, out, "--resume", "--steps", "4"), capsys)
    assert code == 1 and one_error(err) == in_dir
    assert not marker.exists() and tree(out) == before


def test_an_honest_checkpoint_of_an_earlier_version_loads_with_allow_pickle(finished, tmp_path, corpus, capsys):
    state = checkpoint_files.load_file(finished / "checkpoint-3.safetensors")
    old = tmp_path / "old"
    path = write_legacy(state, old, args={"data": str(corpus), "batch_size": 4, "eval_batches": 1}, attn="sdpa")
    del state
    code, _, err = call(evaluate, [str(path), "--device", "cpu"], capsys)
    assert code == 1 and "pass --allow-pickle if you trust this file" in one_error(err)
    code, out, err = call(evaluate, [str(path), "--device", "cpu", "--json", "--allow-pickle"], capsys)
    assert code == 0, err
    assert json.loads(out)["step"] == 3
    code, out, err = call(sample, ["--out", str(old), "--device", "cpu", "--max-new-tokens", "3", "--allow-pickle",
                                   "--prompt", "def "], capsys)
    assert code == 0 and out.startswith("def ") and f"{path} (step 3)" in err


# ------------------------------------------------------------------------------------------------- 3. integrity


@pytest.mark.slow  # train.py runs
def test_flipped_bytes_in_a_checkpoint_are_named(run, capsys):
    newest = run / "checkpoint-3.safetensors"
    flip_bytes(newest, "/model/blocks.0.attn.qkv.weight")
    expected = (f"error: checkpoint {newest} does not load: tensor model/blocks.0.attn.qkv.weight does not match its "
                "checksum (the file is damaged)")
    code, out, err = call(evaluate, [str(newest), "--device", "cpu"], capsys)
    assert code == 1 and out == "" and one_error(err) == expected
    code, out, err = call(sample, ["--ckpt", str(newest), "--device", "cpu"], capsys)
    assert code == 1 and out == "" and one_error(err) == expected
    code, out, err = call(train, ["--resume", "--out", str(run), "--steps", "4"], capsys)
    assert code == 0 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: checkpoint {newest} does not load (tensor model/blocks.0.attn.qkv.weight does not match its "
        "checksum (the file is damaged)); trying an older one"]
    assert f"resuming from {run / 'checkpoint-2.safetensors'} (step 2)" in out


def test_flipped_bytes_in_prepared_tokens_are_named(bpe, tmp_path, capsys):
    data = tmp_path / "bpe"
    shutil.copytree(bpe[0], data)
    train_bin = data / "train.bin"
    content = bytearray(train_bin.read_bytes())
    content[100] ^= 0x01
    train_bin.write_bytes(bytes(content))
    code, _, err = call(train, [*TINY, "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2"], capsys)
    assert code == 1 and one_error(err) == (f"error: {train_bin} does not match the checksum written with it (the file "
                                            "is damaged or was replaced); prepare it again")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------- 4. check, then act


def damage_all_checkpoints(out: Path) -> None:
    for _, path in checkpoint_files.numbered(out):
        flip_bytes(path, "/model/embed.weight")


def lock_it(out: Path):
    lock = RunLock(out)
    lock.acquire()  # held by this process, alive: a second owner is refused
    return lock


@pytest.mark.parametrize("refusal, extra, code, message", [
    ("bad-data", ["--resume", "--data", "/no/such/corpus.txt"], 1, "--data path does not exist: /no/such/corpus.txt"),
    ("another-model", ["--resume", "--d-model", "64"], 2, "--d-model 64 differs from the run in"),
    ("other-data", ["--resume", "--data", "OTHER"], 1, r"is not the data the run in .* trained on"),
    ("bad-checkpoint", ["--resume"], 1, r"no checkpoint in .* loads: checkpoint-3.safetensors \(tensor model/embed"),
    ("below-its-step", ["--resume", "--steps", "2"], 1, r"--steps 2 is below the step of .*checkpoint-3.safetensors"),
    ("locked", ["--resume"], 1, r"is in use by another run \(process \d+ on "),
    ("locked-overwrite", ["--overwrite"], 1, r"is in use by another run"),
    ("new-run-into-a-run", [], 1, r"already holds a run \(checkpoint-1.safetensors, checkpoint-2.safetensors, "
                                  r"checkpoint-3.safetensors, \.\.\.\); continue it with --resume"),
    ("overwrite-with-bad-data", ["--overwrite", "--data", "/no/such/corpus.txt"], 1, "--data path does not exist"),
    ("bad-flag", ["--resume", "--attn", "sdpa-flash"], 2, "--attn sdpa-flash cannot run on cpu"),
])
def test_every_refusal_leaves_the_run_directory_as_it_was(run, corpus, tmp_path, capsys, refusal, extra, code,
                                                          message):
    if refusal == "bad-checkpoint":
        damage_all_checkpoints(run)
    lock = lock_it(run) if refusal.startswith("locked") else None
    other = tmp_path / "other.txt"
    other.write_bytes((STDLIB / "shlex.py").read_bytes() * 4)
    extra = [str(other) if a == "OTHER" else a for a in extra]
    before = tree(run)
    try:
        status, _, err = call(train, [*training(corpus, run, "--steps", "5"), *extra], capsys)
    finally:
        if lock is not None:
            lock.release()
    assert status == code and re.search(message, one_error(err, warnings=2 if refusal == "bad-checkpoint" else 0)), err
    if lock is not None:
        del before[".lock"]
    assert tree(run) == before
    assert not list(tmp_path.glob("run.old-*")), "--overwrite moved nothing aside"


@pytest.mark.parametrize("refusal, extra, code, message", [
    ("bad-data", ["--data", "/no/such/corpus.txt"], 1, "--data path does not exist"),
    ("nothing-to-resume", ["--resume"], 1, r"no checkpoint to resume from in .*run \(looked for "
                                           r"checkpoint-<step>.safetensors\)"),
    ("too-short", ["--data", "SHORT"], 1, "too short for a training and a validation window"),
    ("bad-flag", ["--steps", "0"], 2, "--steps must be >= 1"),
    ("pack-documents-on-text", ["--pack-documents"], 1, "--pack-documents needs prepared data"),
])
def test_a_fresh_out_that_is_refused_leaves_no_directory(tmp_path, corpus, capsys, refusal, extra, code, message):
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    out = tmp_path / "new" / "deeper" / "run"
    argv = [*training(corpus, out, "--steps", "2"), *[str(short) if a == "SHORT" else a for a in extra]]
    status, _, err = call(train, argv, capsys)
    assert status == code and re.search(message, one_error(err)), err
    assert not out.exists()
    # The directories it created are gone, but for the token cache beside --out, when the data was read.
    left = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and ".token_cache" not in p.parts]
    assert sorted(map(str, left)) == ["short.txt"]


# -------------------------------------------------------------------------------- 5. a run records what it trained on


def test_a_run_records_its_data_and_a_resume_on_other_data_needs_data_changed(run, corpus, tmp_path, capsys):
    note = json.loads((run / DATA_NOTE).read_text())
    assert note["kind"] == "bytes" and note["data"] == str(corpus)
    assert re.fullmatch(r"crc32:[0-9a-f]{8}:\d+", note["fingerprint"]) and "history" not in note
    other = tmp_path / "other.txt"
    other.write_bytes((STDLIB / "shlex.py").read_bytes() * 4)
    resume = training(other, run, "--resume", "--steps", "5", "--log-every", "1")
    before = tree(run)
    code, _, err = call(train, resume, capsys)
    assert code == 1 and one_error(err) == (
        f"error: --data {other} (text file {other} (bytes)) is not the data the run in {run} trained on (text file "
        f"{corpus} (bytes), recorded in {run / DATA_NOTE}); pass --data-changed to train on it anyway")
    assert tree(run) == before
    code, out, err = call(train, [*resume, "--data-changed"], capsys)
    assert code == 0 and "Traceback" not in err, err
    now = json.loads((run / DATA_NOTE).read_text())
    assert now["data"] == str(other) and now["fingerprint"] != note["fingerprint"]
    [earlier] = now["history"]
    assert {k: v for k, v in earlier.items() if k != "replaced_because"} == note
    assert earlier["replaced_because"].startswith(f"--data {other} (text file {other} (bytes)) is not the data")
    after = rows(run)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert "data_changed" not in after[2] and after[3]["data_changed"] == earlier["replaced_because"]
    assert "data_changed" not in after[4]
    # Resumed again on the data it now trains on: no change to record, the history kept.
    code, _, err = call(train, training(other, run, "--resume", "--steps", "6"), capsys)
    assert code == 0 and json.loads((run / DATA_NOTE).read_text())["history"] == now["history"]


def test_a_resume_on_prepared_data_of_another_tokenizer_is_refused(bpe, tmp_path, capsys):
    one, two = bpe
    out = tmp_path / "run"
    assert train.main([*TINY, "--data", str(one), "--out", str(out), "--steps", "2"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (one / "tokenizer.json").read_bytes()
    note = json.loads((out / DATA_NOTE).read_text())
    assert note["kind"] == "prepared" and note["data"] == str(one) and note["vocab_size"] == 300
    assert note["fingerprint"] == f"prepared:{json.loads((one / 'meta.json').read_text())['key']}"
    capsys.readouterr()
    before = tree(out)
    code, _, err = call(train, [*TINY, "--data", str(two), "--out", str(out), "--steps", "4", "--resume"], capsys)
    assert code == 1
    line = one_error(err)
    assert line.startswith(f"error: --data {two} (bpe tokens of text file ") and str(one) in line
    assert line.endswith("pass --data-changed to train on it anyway")
    assert tree(out) == before  # tokenizer.json and data.json among them


def test_evaluate_refuses_a_corpus_that_changed_since_unless_data_changed(tmp_path, corpus, capsys):
    text = tmp_path / "corpus.txt"
    shutil.copy(corpus, text)
    out = tmp_path / "run"
    assert train.main(training(text, out, "--steps", "2")) == 0
    capsys.readouterr()
    assert call(evaluate, [str(out), "--device", "cpu", "--json"], capsys)[0] == 0
    with open(text, "a") as f:
        f.write("\n# a line added after the run\n")
    code, stdout, err = call(evaluate, [str(out), "--device", "cpu"], capsys)
    assert code == 1 and stdout == "" and one_error(err) == (
        f"error: text file {text} (bytes) is no longer the data the run in {out} trained on (its content changed "
        f"since; recorded in {out / DATA_NOTE}); pass --data-changed to evaluate on it anyway")
    code, stdout, err = call(evaluate, [str(out), "--device", "cpu", "--json", "--data-changed"], capsys)
    assert code == 0 and json.loads(stdout)["step"] == 2, err


def test_sample_refuses_a_swapped_tokenizer(bpe, tmp_path, capsys):
    one, two = bpe
    out = tmp_path / "run"
    assert train.main([*TINY, "--data", str(one), "--out", str(out), "--steps", "1"]) == 0
    capsys.readouterr()
    code, _, err = call(sample, ["--out", str(out), "--device", "cpu", "--max-new-tokens", "2"], capsys)
    assert code == 0, err
    (out / "tokenizer.json").write_bytes((two / "tokenizer.json").read_bytes())
    code, stdout, err = call(sample, ["--out", str(out), "--device", "cpu", "--max-new-tokens", "2"], capsys)
    assert code == 1 and stdout == ""
    line = one_error(err)
    assert line.startswith(f"error: {out / 'tokenizer.json'} is not the tokenizer the run trained with (fingerprint ")
    assert line.endswith(f"in {out / DATA_NOTE})")


# ------------------------------------------------------------------------------------------------------ 7. memory


CPU_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")


@pytest.fixture
def no_memory(monkeypatch):
    def forward(*a, **k):
        raise CPU_OOM

    monkeypatch.setattr(TransformerLM, "forward", forward)


def test_running_out_of_cpu_memory_names_the_flags_to_lower(finished, tmp_path, corpus, capsys, no_memory):
    code, _, err = call(train, training(corpus, tmp_path / "run", "--steps", "2"), capsys)
    assert code == 1 and one_error(err) == (
        "error: out of CPU memory with --batch-size 4 --context-length 32 --d-model 32 --n-layers 2 --dtype fp32; "
        "lower --batch-size, --context-length or --size, or add --activation-checkpointing")
    code, stdout, err = call(evaluate, [str(finished), "--device", "cpu"], capsys)
    assert code == 1 and stdout == "" and one_error(err) == (
        "error: out of CPU memory with this --batch-size; lower --batch-size")
    code, stdout, err = call(sample, ["--out", str(finished), "--device", "cpu"], capsys)
    assert code == 1 and one_error(err.split("\n", 1)[1]) == (
        "error: out of CPU memory with this model; lower --max-new-tokens, or use --dtype bf16")
