"""Synthetic tokens: uniform random ids, no structure to learn; for throughput runs."""

from __future__ import annotations

import numpy as np

from training.data.source import DataSource, split_train_val

SYNTHETIC_VOCAB = 10_000
SYNTHETIC_TOKENS = 2_000_000


def open_synthetic(vocab_size: int, seed: int, context_length: int) -> DataSource:
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=SYNTHETIC_TOKENS, dtype=np.int64)
    tokens = tokens.astype(np.uint16 if vocab_size <= 65536 else np.int64)
    description = f"synthetic uniform tokens (vocab {vocab_size})"
    train, val = split_train_val(tokens, context_length, name=description)
    return DataSource(train, val, description, vocab_size,
                      identity={"kind": "synthetic", "source": "synthetic", "vocab_size": vocab_size, "seed": seed,
                                "fingerprint": f"synthetic:{vocab_size}:{seed}"})
