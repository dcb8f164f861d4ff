"""Token files: a .bin of uint16 ids (no header) or a .npy array of integer ids; their vocabulary is not recorded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.data.source import DataError, DataSource, content_crc, split_train_val


def open_tokens(path: Path, context_length: int) -> DataSource:
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"--data {path} is empty")
        if size % 2:
            raise DataError(f"--data {path} has an odd number of bytes ({size:,}): a .bin token file holds uint16 ids "
                            "of 2 bytes each (a text file should not end in .bin)")
        tokens, description = np.memmap(path, dtype=np.uint16, mode="r"), f"uint16 token file {path}"
    else:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"--data {path} is not a .npy array of token ids: {e}") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"--data {path} must hold a 1-d integer token array, got shape {tokens.shape}, "
                            f"{tokens.dtype}")
        description = f"token array {path}"
    train, val = split_train_val(tokens, context_length, name=description)
    return DataSource(train, val, description, None,
                      identity={"kind": "tokens", "source": str(path), "fingerprint": content_crc(tokens)})
