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


class GanNets(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        self.d = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.d(x)


class GanStepTask(GanTask):
    """A real GAN step: the discriminator's update, then the generator's, from two losses
    (``train_step``). Noise comes from each rank's RNG stream. After each step the task
    checks that every rank holds the same weights: the engine averaged every update."""

    def build_model(self) -> nn.Module:
        return GanNets()

    def build_datasets(self):
        gen = torch.Generator().manual_seed(0)
        angle = torch.rand(self.cfg.samples, generator=gen) * 6.283
        real = torch.stack([angle.cos(), angle.sin()], dim=1)
        return TensorSet(real), TensorSet(real[:128])

    def configure_optimizers(self, model, ctx):
        d = torch.optim.Adam(model.d.parameters(), lr=2e-3, betas=(0.5, 0.999))
        g = torch.optim.Adam(model.g.parameters(), lr=1e-3, betas=(0.5, 0.999))
        return {
            "d": OptimizerSpec(d, schedule=torch.optim.lr_scheduler.StepLR(d, 5, gamma=0.5)),
            "g": OptimizerSpec(g, schedule=lambda step: min(1.0, (step + 1) / 4)),
        }

    def train_step(self, model, batch, optimizers, ctx) -> TaskOutput:
        (real,) = batch
        ones = torch.ones(len(real), 1)
        zeros = torch.zeros(len(real), 1)
        fake = model.g(torch.randn(len(real), 2))
        loss_d = F.binary_cross_entropy_with_logits(
            model.d(real), ones
        ) + F.binary_cross_entropy_with_logits(model.d(fake.detach()), zeros)
        optimizers.backward(loss_d, "d")
        optimizers.step("d")
        loss_g = F.binary_cross_entropy_with_logits(model.d(fake), ones)
        optimizers.backward(loss_g, "g")
        optimizers.step("g")
        if optimizers.final:
            _same_on_every_rank(model)
        return TaskOutput(loss=loss_d.detach() + loss_g.detach(), samples=len(real))

    def compute(self, model, batch) -> TaskOutput:
        (real,) = batch
        target = torch.ones(len(real), 1)
        loss = F.binary_cross_entropy_with_logits(model(real), target)
        return TaskOutput(loss=loss, samples=len(real))


def _same_on_every_rank(model) -> None:
    import torch.distributed as dist

    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    if not all(torch.equal(every[0], other) for other in every[1:]):
        raise AssertionError("the ranks' weights differ: an update was not averaged")
