import math

import pytest

from training.optim.schedule import lr_at


def test_warmup_is_linear_then_cosine_to_min():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)  # half way through the cosine
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9)
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
