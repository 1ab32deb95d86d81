"""A user task for gpu-console: regress sin(x) with a small MLP.

Use it from a profile with ``kind = "examples.sine_task:SineTask"`` (see profiles/sine.toml);
the module is imported from the directory you launch gpu-console in, like ``python -m``.
A task needs a ``Config`` dataclass (its own ``[task]`` keys, each with a default) and
three methods: ``build_model``, ``build_datasets`` (train, eval; the same on every rank)
and ``compute`` (the loss of one batch, already on the rank's device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import TaskOutput, TensorSet


@dataclass
class SineConfig:
    hidden: int = 64
    samples: int = 8192
    periods: float = 2.0


class SineTask:
    Config = SineConfig

    def __init__(self, config: SineConfig):
        self.cfg = config

    def build_model(self) -> nn.Module:
        h = self.cfg.hidden
        return nn.Sequential(
            nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)
        )

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        span = self.cfg.periods * math.pi
        x = (torch.rand(self.cfg.samples, 1, generator=g) * 2 - 1) * span
        x_eval = torch.linspace(-span, span, 512).unsqueeze(1)
        return TensorSet(x, torch.sin(x)), TensorSet(x_eval, torch.sin(x_eval))

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        x, y = batch
        loss = F.mse_loss(model(x).float(), y)
        return TaskOutput(loss=loss, samples=len(x))
