"""Learning-rate schedules: a linear warm-up, then a cosine decay to a floor.

Pure functions of (step, steps, peak lr); they know nothing of optimizers or models.
"""

from __future__ import annotations

import math


def warmup_cosine_lr(
    step: int, steps: int, lr: float, warmup_frac: float = 0.1, floor: float = 0.1
) -> float:
    """Linear warm-up over the first `warmup_frac` of `steps` (at least one step when
    `warmup_frac` > 0), then cosine decay from `lr` towards `floor * lr`, reached one step
    past the last."""
    warmup = max(1, int(steps * warmup_frac)) if warmup_frac > 0 else 0
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
