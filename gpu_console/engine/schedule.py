"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor.

The decay takes ``train.lr_decay_steps`` steps after warmup (0: until ``max_steps``), then
the lr stays at the floor: the higher of ``min_lr_ratio × lr`` and ``min_lr`` (both scaled
with the lr by ``distributed.lr_scaling``, so the floor is a fixed fraction of the peak).
"""

from __future__ import annotations

import math

from ..profile import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for the update that follows ``step`` completed steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = decay_steps(cfg)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = floor_ratio(cfg)
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_steps(cfg: TrainConfig) -> int:
    return cfg.lr_decay_steps or max(1, cfg.max_steps - cfg.warmup_steps)


def floor_ratio(cfg: TrainConfig) -> float:
    """The decay's floor as a fraction of the peak lr."""
    return max(cfg.min_lr_ratio, cfg.min_lr / cfg.lr) if cfg.min_lr else cfg.min_lr_ratio


def scaled_lr(lr: float, world_size: int, scaling: str) -> float:
    if scaling == "linear":
        return lr * world_size
    if scaling == "sqrt":
        return lr * math.sqrt(world_size)
    return lr
