import math

import pytest
import torch

from training.data.sampling import Batch
from training.evaluation import Evaluation, evaluate


def constant_loss(value: float):
    return lambda x, y: torch.tensor(value)


def test_bits_per_byte_is_loss_times_tokens_over_ln2_bytes():
    x = torch.zeros(2, 4, dtype=torch.int64)
    y = torch.tensor([[1, 2, 1, 2], [2, 2, 1, 1]])  # token 1 stands for 1 byte, token 2 for 3 bytes: 16 bytes
    token_bytes = torch.tensor([1, 1, 3])
    result = evaluate(constant_loss(2.0), [Batch(x, y)], token_bytes)
    assert result.loss == 2.0 and result.tokens == 8
    assert result.bpb == pytest.approx(2.0 * 8 / (math.log(2) * 16))
    assert result.perplexity == pytest.approx(math.exp(2.0))
    assert result.metrics() == {"val_loss": 2.0, "val_bpb": result.bpb}


def test_byte_level_bits_per_byte_are_loss_over_ln2_exactly():
    y = torch.randint(0, 256, (3, 8))
    result = evaluate(constant_loss(1.2345), [Batch(y, y)] * 2, torch.ones(256, dtype=torch.int64))
    assert result.bpb == result.loss / math.log(2)


def test_unknown_bytes_give_no_bits_per_byte():
    y = torch.zeros(1, 4, dtype=torch.int64)
    result = evaluate(constant_loss(3.0), [Batch(y, y)])
    assert result.bpb is None and result.metrics() == {"val_loss": 3.0}
    assert Evaluation(800.0, None, 1).perplexity == math.inf


def test_batches_are_weighted_by_their_tokens():
    long, short = torch.zeros(2, 6, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64)
    losses = iter([torch.tensor(1.0), torch.tensor(4.0)])
    result = evaluate(lambda x, y: next(losses), [Batch(long, long), Batch(short, short)])
    assert result.loss == pytest.approx((1.0 * 12 + 4.0 * 3) / 15) and result.tokens == 15
    with pytest.raises(ValueError, match="no batches"):
        evaluate(constant_loss(1.0), [])

