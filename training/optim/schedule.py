"""Learning-rate schedules: linear warm-up, then cosine decay to a floor, or warm-up-stable-decay (WSD).

WSD holds the peak learning rate and decays linearly over the run's last steps (Hu et al., "MiniCPM", 2024; the
"trapezoidal" schedule of modded-nanogpt's speedruns): most of the run at the peak, and a decay whose length does
not depend on when the run was planned to end.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """LR for optimizer step `step` (0-based): ramps to max_lr over warmup_steps, then decays to min_lr at
    total_steps: along a cosine over the steps after the warm-up, or (wsd) linearly over the last decay_fraction of
    all steps, constant before."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    if schedule == "wsd":
        decay_start = max(warmup_steps, total_steps - round(decay_fraction * total_steps))
        if step < decay_start:
            return max_lr
        return max_lr + (step - decay_start) / max(1, total_steps - decay_start) * (min_lr - max_lr)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
