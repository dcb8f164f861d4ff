"""What a run records about its data in its output directory, so that evaluation and sampling use what it trained on.

A run on prepared data keeps a copy of its tokenizer (`tokenizer.json`) and a note of the data (`data.json`); a run
on text bytes or token files records no tokenizer (bytes decode as UTF-8).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from training.data.hf_tokenizer import hf_data_note
from training.data.source import DataError, DataSource
from training.data.tokenizer import EOD_TOKEN, TOKENIZER_FILE, Tokenizer, load_tokenizer
from training.run.files import write_atomic

DATA_NOTE = "data.json"


def record_data(source: DataSource, out: Path) -> None:
    """Copy the prepared data's tokenizer and a note of the data into the run's output directory."""
    if source.identity.get("kind") != "prepared":
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = Path(source.identity["source"]) / TOKENIZER_FILE
    if tokenizer_file.exists():
        write_atomic(out / TOKENIZER_FILE, lambda f: f.write(tokenizer_file.read_bytes()))
    note = {"data": source.identity["source"], **{k: source.identity[k] for k in (
        "corpus", "tokenizer", "tokenizer_fingerprint", "vocab_size", "eod_id")}}
    write_atomic(out / DATA_NOTE, lambda f: f.write((json.dumps(note, indent=2) + "\n").encode()))


def record_hf_tokenizer(directory: Path, source: DataSource, out: Path) -> None:
    """The tokenizer of a Hugging Face directory a run starts from (--init-from) into the run's output directory, when
    its data records none (token files; prepared data records its own, synthetic tokens encode no text)."""
    note = hf_data_note(directory)
    if note is None or source.identity.get("kind") != "tokens":
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = directory / TOKENIZER_FILE
    write_atomic(out / TOKENIZER_FILE, lambda f: f.write(tokenizer_file.read_bytes()))
    note = {**note, "data": source.identity["source"], "tokenizer_from": str(directory)}
    write_atomic(out / DATA_NOTE, lambda f: f.write((json.dumps(note, indent=2) + "\n").encode()))


def data_note(run_dir: Path) -> Optional[dict]:
    """What record_data wrote for a run; None for a run on other data (byte-level text, token files). A Hugging Face
    directory (export.py's, or one from elsewhere) records no data: its tokenizer.json speaks for it."""
    path = run_dir / DATA_NOTE
    return json.loads(path.read_text()) if path.exists() else hf_data_note(run_dir)


def run_tokenizer(run_dir: Path) -> Optional[Tokenizer]:
    """The tokenizer a run trained with, from its output directory; None when it trained on no prepared data."""
    note = data_note(run_dir)
    return None if note is None else load_tokenizer(note["tokenizer"], run_dir, note.get("eod_token", EOD_TOKEN))


def check_same_tokenizer(run_dir: Path, source: DataSource, spec: Optional[str]) -> None:
    """Evaluating a run needs data tokenized as the run's training data was."""
    note = data_note(run_dir)
    name = spec or "the built-in corpus"
    ours = source.identity
    prepared = ours.get("kind") == "prepared"
    if note is None:  # trained on byte-level text or token files: prepared data fits only if it is bytes too
        if prepared and ours["tokenizer"] != "bytes":
            raise DataError(f"{name} holds {ours['tokenizer']} tokens, but the run in {run_dir} was not trained on "
                            "prepared data (it records no tokenizer)")
        return
    if ours.get("kind") == "tokens":  # token files name no tokenizer: taken as the run's (their ids are checked)
        return
    if not prepared:
        if note["tokenizer"] != "bytes":
            raise DataError(f"the run in {run_dir} was trained on {note['tokenizer']} tokens ({note['data']}); {name} "
                            "is not prepared with its tokenizer")
        return
    if note["tokenizer_fingerprint"] != ours["tokenizer_fingerprint"]:
        raise DataError(f"{name} is tokenized with another tokenizer ({ours['tokenizer']}, vocabulary "
                        f"{ours['vocab_size']}) than the run in {run_dir} was trained with ({note['tokenizer']}, "
                        f"vocabulary {note['vocab_size']}, from {note['data']})")
