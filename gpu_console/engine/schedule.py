"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from ..profile import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for the update that follows ``step`` completed steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scaled_lr(lr: float, world_size: int, scaling: str) -> float:
    if scaling == "linear":
        return lr * world_size
    if scaling == "sqrt":
        return lr * math.sqrt(world_size)
    return lr
