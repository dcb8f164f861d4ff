"""What a run records about its data, and the checks that keep a run bound to it.

Every run writes `data.json` in its output directory: the kind and path of its data, a fingerprint of its content
(a CRC-32 of the tokens, or the content hash a prepared directory was made from), and for prepared data its
tokenizer (whose `tokenizer.json` it copies beside). A resume, evaluate.py and sample.py compare against it: other
data or another tokenizer is refused with one line naming both, unless the change is meant (--data-changed), which
the record then keeps in its history.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from training.data.hf_tokenizer import hf_data_note
from training.data.source import DataError, DataSource
from training.data.tokenizer import EOD_TOKEN, TOKENIZER_FILE, Tokenizer, load_tokenizer
from training.run.files import write_atomic

DATA_NOTE = "data.json"
_TOKENIZER_KEYS = ("corpus", "tokenizer", "tokenizer_fingerprint", "vocab_size", "eod_id")


def data_note(run_dir: Path) -> Optional[dict]:
    """What a run recorded of its data; None for a run of a version that did not record it. A Hugging Face directory
    (export.py's, or one from elsewhere) records no data: its tokenizer.json speaks for it."""
    path = run_dir / DATA_NOTE
    if not path.is_file():
        return hf_data_note(run_dir)
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a data record: {e}") from None
    return note if isinstance(note, dict) else None


def note_of(source: DataSource) -> dict[str, Any]:
    note = {"data": source.identity.get("source"), "kind": source.identity.get("kind"),
            "description": source.description, "fingerprint": source.identity.get("fingerprint")}
    return note | {k: source.identity[k] for k in _TOKENIZER_KEYS if k in source.identity}


def same_data(recorded: dict, source: DataSource) -> bool:
    """Whether `source` is the data a record describes: the same content (fingerprint); records of earlier versions,
    which keep no fingerprint, by the tokenizer alone."""
    if recorded.get("fingerprint") is not None:
        return recorded["fingerprint"] == source.identity.get("fingerprint")
    return recorded.get("tokenizer_fingerprint") == source.identity.get("tokenizer_fingerprint")


def check_resume_data(out: Path, source: DataSource, changed: bool) -> Optional[str]:
    """Before a resume touches anything: the data must be the run's, unless `changed` (--data-changed) says the
    change is meant. Returns a line describing a meant change, else None."""
    recorded = data_note(out)
    if recorded is None or same_data(recorded, source):
        return None
    line = (f"--data {source.identity.get('source')} ({source.description}) is not the data the run in {out} trained "
            f"on ({recorded.get('description') or recorded.get('data')}, recorded in {out / DATA_NOTE})")
    if not changed:
        raise DataError(f"{line}; pass --data-changed to train on it anyway")
    return line


def check_data_unchanged(run_dir: Path, source: DataSource, changed: bool) -> None:
    """evaluate.py on a run's own --data: the data must still be what the run trained on, unless `changed`."""
    recorded = data_note(run_dir)
    if recorded is None or same_data(recorded, source) or changed:
        return
    raise DataError(f"{source.description} is no longer the data the run in {run_dir} trained on (its content changed "
                    f"since; recorded in {run_dir / DATA_NOTE}); pass --data-changed to evaluate on it anyway")


def record_data(source: DataSource, out: Path, change: Optional[str] = None,
                tokenizer_from: Optional[Path] = None) -> None:
    """Write data.json (and copy a prepared directory's tokenizer, or that of the Hugging Face directory the run
    starts from when its data names none); a meant change keeps the earlier record."""
    note = note_of(source)
    earlier = data_note(out) if (out / DATA_NOTE).is_file() else None
    if earlier is not None and change is not None:
        note["history"] = [*earlier.pop("history", []), {**earlier, "replaced_because": change}]
    elif earlier is not None:
        note = {**{k: v for k, v in earlier.items() if k in ("tokenizer_from", "eod_token") or k in _TOKENIZER_KEYS},
                **note, **({"history": earlier["history"]} if earlier.get("history") else {})}
    tokenizer_file = None
    if source.identity.get("kind") == "prepared":
        tokenizer_file = Path(source.identity["source"]) / TOKENIZER_FILE
    elif tokenizer_from is not None and source.identity.get("kind") == "tokens" and hf_data_note(tokenizer_from):
        tokenizer_file = tokenizer_from / TOKENIZER_FILE
        note = {**hf_data_note(tokenizer_from), **note, "tokenizer_from": str(tokenizer_from)}
    if tokenizer_file is not None and tokenizer_file.exists():
        write_atomic(out / TOKENIZER_FILE, lambda f: f.write(tokenizer_file.read_bytes()))
    write_atomic(out / DATA_NOTE, lambda f: f.write((json.dumps(note, indent=2) + "\n").encode()))


def run_tokenizer(run_dir: Path) -> Optional[Tokenizer]:
    """The tokenizer a run trained with, from its output directory, checked against its record (a swapped
    tokenizer.json would decode wrongly); None when it trained on bytes or token files."""
    note = data_note(run_dir)
    if note is None or note.get("tokenizer") is None:
        return None
    tokenizer = load_tokenizer(note["tokenizer"], run_dir, note.get("eod_token", EOD_TOKEN))
    if note.get("tokenizer_fingerprint") and tokenizer.fingerprint() != note["tokenizer_fingerprint"]:
        raise DataError(f"{run_dir / TOKENIZER_FILE} is not the tokenizer the run trained with (fingerprint "
                        f"{tokenizer.fingerprint()}, recorded {note['tokenizer_fingerprint']} in {run_dir / DATA_NOTE})")
    return tokenizer


def check_same_tokenizer(run_dir: Path, source: DataSource, spec: Optional[str]) -> None:
    """Evaluating a run needs data tokenized as the run's training data was."""
    note = data_note(run_dir)
    name = spec or "the built-in corpus"
    ours = source.identity
    prepared = ours.get("kind") == "prepared"
    trained_on = None if note is None else note.get("tokenizer")
    if trained_on is None:  # trained on byte-level text or token files: prepared data fits only if it is bytes too
        if prepared and ours["tokenizer"] != "bytes":
            raise DataError(f"{name} holds {ours['tokenizer']} tokens, but the run in {run_dir} was not trained on "
                            "prepared data (it records no tokenizer)")
        return
    if ours.get("kind") == "tokens":  # token files name no tokenizer: taken as the run's (their ids are checked)
        return
    if not prepared:
        if trained_on != "bytes":
            raise DataError(f"the run in {run_dir} was trained on {trained_on} tokens ({note['data']}); {name} is not "
                            "prepared with its tokenizer")
        return
    if note["tokenizer_fingerprint"] != ours["tokenizer_fingerprint"]:
        raise DataError(f"{name} is tokenized with another tokenizer ({ours['tokenizer']}, vocabulary "
                        f"{ours['vocab_size']}) than the run in {run_dir} was trained with ({trained_on}, "
                        f"vocabulary {note['vocab_size']}, from {note['data']})")

