"""Group-relative advantages (GRPO): each episode's reward minus its group's mean.

Groups whose rewards are all equal carry no learning signal and are skipped (and
counted). This module sees rewards only, not tokens or models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class GroupAdvantages:
    advantages_G: list[float]
    skipped: bool


def group_advantages(
    rewards_G: list[float], normalize_std: bool = False, eps: float = 1e-6
) -> GroupAdvantages:
    """A_i = r_i - mean(r); divided by std(r) + eps when `normalize_std`.

    A group whose rewards are all equal (within eps) gets zeros and `skipped=True`.
    """
    if not rewards_G:
        raise ValueError("a group needs at least one reward")
    for r in rewards_G:
        if not math.isfinite(r):
            raise ValueError(f"reward {r} is not finite")
    mean = sum(rewards_G) / len(rewards_G)
    if max(rewards_G) - min(rewards_G) <= eps:
        return GroupAdvantages([0.0] * len(rewards_G), skipped=True)
    centred = [r - mean for r in rewards_G]
    if normalize_std:
        std = math.sqrt(sum(c * c for c in centred) / len(centred))
        centred = [c / (std + eps) for c in centred]
    return GroupAdvantages(centred, skipped=False)
