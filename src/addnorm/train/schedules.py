"""Learning-rate schedules as multipliers of the peak learning rate.

For step t (0-based) with W warmup steps and T steps in all:

    warmup        m(t) = (t + 1) / W                                   for t < W  (never 0: no wasted step)
    cosine        m(t) = r + (1 - r) * (1 + cos(pi * p)) / 2,  p = (t - W) / max(1, T - W - 1)   in [0, 1]
    inverse_sqrt  m(t) = sqrt(max(W, 1) / (t + 1))                     (1 at the end of warmup, then decays)
    constant      m(t) = 1

r is ``min_lr_ratio`` (cosine ends at r * peak). The multiplier also scales independent weight decay (Wortsman
et al. 2023 decay parameters by ``wd * m(t)``, not by ``lr * wd``).
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "inverse_sqrt", "constant")

__all__ = ["SCHEDULES", "lr_multiplier", "make_scheduler"]


def lr_multiplier(step: int, *, schedule: str, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """The factor applied to the peak learning rate at ``step`` (see the module docstring for the formulas)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if total < 1:
        raise ValueError(f"total must be >= 1, got {total}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, schedule: str, warmup: int, total: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier` (its state_dict holds the step, for checkpoints)."""
    lr_multiplier(0, schedule=schedule, warmup=warmup, total=total, min_lr_ratio=min_lr_ratio)  # validate now
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, schedule=schedule, warmup=warmup, total=total, min_lr_ratio=min_lr_ratio),
    )
