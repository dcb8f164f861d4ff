"""Read back an offline W&B run file (`run-*.wandb`): the LevelDB log format holding protobuf Records.

W&B 0.31 no longer ships a Python reader, so tests parse the file themselves: a 7-byte header, then
32 KiB blocks of records, each with a 7-byte header (crc32, little-endian length, type) and a payload that
may be split across blocks (FIRST/MIDDLE/LAST).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # block trailer is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        payload = chunk if kind in (FULL, FIRST) else payload + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def history_and_summary(run_dir: Path, min_rows: int = 1, wait_s: float = 15.0) -> tuple[list[dict], dict]:
    """(history rows as dicts, final summary) of the single offline run under `run_dir`.

    W&B's service process may still be writing the file when `finish()` returns, so wait up to `wait_s`
    for at least `min_rows` history rows and a summary.
    """
    deadline = time.monotonic() + wait_s
    while True:
        history, summary = _read(run_dir)
        if (len(history) >= min_rows and summary) or time.monotonic() > deadline:
            return history, summary
        time.sleep(0.5)


def _read(run_dir: Path) -> tuple[list[dict], dict]:
    (path,) = Path(run_dir).glob("offline-run-*/run-*.wandb")
    history, summary = [], {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
        elif kind == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, summary
