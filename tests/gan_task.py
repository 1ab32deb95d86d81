"""A GAN-shaped toy task with two optimizers of its own (tests/test_task_optimizers.py).

A generator ``g`` maps noise-free inputs to features and a discriminator-like head ``d``
scores them; one loss trains both, each part with its own optimizer and schedule: ``g`` with
Adam (GAN betas) and a warmup function, ``d`` with SGD (momentum) and a ReduceLROnPlateau
on the eval loss that is impatient enough to cut the lr within a short run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import OptimizerSpec, TaskOutput, TensorSet


@dataclass
class GanConfig:
    samples: int = 2048
    dropout: float = 0.1  # draws from every rank's RNG stream: a resume must restore it


class GanModel(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(dropout))
        self.d = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.d(self.g(x))


class GanTask:
    Config = GanConfig

    def __init__(self, config: GanConfig):
        self.cfg = config
        self.seen_ctx = None

    def build_model(self) -> nn.Module:
        return GanModel(self.cfg.dropout)

    def build_datasets(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(self.cfg.samples, 4, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        return TensorSet(x, y), TensorSet(x[:256], y[:256])

    def configure_optimizers(self, model, ctx):
        self.seen_ctx = (ctx.rank, ctx.world_size)
        g = torch.optim.Adam(model.g.parameters(), lr=2e-3, betas=(0.5, 0.999))
        d = torch.optim.SGD(
            [
                {"params": model.d[0].parameters(), "weight_decay": 1e-4},
                {"params": model.d[2].parameters(), "lr": 2e-2},
            ],
            lr=1e-2 * ctx.world_size,
            momentum=0.9,
        )
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            d, mode="min", factor=0.5, patience=0, threshold=0.5
        )
        return {
            "g": OptimizerSpec(g, schedule=lambda step: min(1.0, (step + 1) / 4)),
            "d": OptimizerSpec(d, schedule=plateau, monitor="loss"),
        }

    def compute(self, model, batch) -> TaskOutput:
        x, y = batch
        loss = F.mse_loss(model(x), y)
        return TaskOutput(loss=loss, samples=len(x))
