"""A small GAN with two optimizers and its own step (examples/gan.toml).

The shape of PyTorch's DCGAN example, on 2-D points (a ring of eight Gaussians) so that it
trains in seconds on a CPU: each step updates the discriminator on real and generated points,
then the generator through the updated discriminator (``train_step``), each network with its
own Adam (``configure_optimizers``, the GAN betas). The engine averages each update over the
ranks; the step events chart ``Loss_D``, ``Loss_G``, ``D(x)`` and ``D(G(z))``. At the end
of each epoch rank 0 writes the generator's points for a fixed noise into the run's task
directory (``samples-epoch-NNN.csv``), as DCGAN saves its image grid. ``gpu-console export``
writes the two networks as ``G`` and ``D``.

Only the documented task API (``gpu_console.tasks.base``) and plain torch are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_console.tasks.base import OptimizerSpec, TaskOutput, TensorSet


@dataclass
class GanConfig:
    samples: int = 4096  # real points
    nz: int = 8  # noise dimensions
    hidden: int = 64
    lr_d: float = 1e-3
    lr_g: float = 1e-3
    beta1: float = 0.5
    samples_out: int = 256  # generated points written at each epoch's end


def ring(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` points around eight Gaussians on the unit circle."""
    g = torch.Generator().manual_seed(seed)
    mode = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    centres = torch.stack([mode.cos(), mode.sin()], dim=1)
    return centres + 0.05 * torch.randn(n, 2, generator=g)


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
        nn.Linear(hidden, d_out),
    )  # fmt: skip


class GanModel(nn.Module):
    def __init__(self, nz: int, hidden: int):
        super().__init__()
        self.g = mlp(nz, hidden, 2)  # generator: noise -> point
        self.d = mlp(2, hidden, 1)  # discriminator: point -> logit (real)

    def forward(self, z):
        return self.d(self.g(z))


def bce(logits: torch.Tensor, real: bool) -> torch.Tensor:
    target = torch.ones_like(logits) if real else torch.zeros_like(logits)
    return F.binary_cross_entropy_with_logits(logits, target)


class Gan:
    Config = GanConfig

    def __init__(self, config: GanConfig):
        self.cfg = config
        # The fixed noise the epoch samples are drawn from (DCGAN's fixed_noise): its own
        # generator, so writing samples draws nothing from the training's RNG streams.
        self.fixed_noise = torch.randn(
            config.samples_out, config.nz, generator=torch.Generator().manual_seed(1)
        )

    def build_model(self) -> nn.Module:
        return GanModel(self.cfg.nz, self.cfg.hidden)

    def build_datasets(self):
        return TensorSet(ring(self.cfg.samples)), None  # no eval set: a GAN is judged by eye

    def configure_optimizers(self, model, ctx):
        betas = (self.cfg.beta1, 0.999)
        d = torch.optim.Adam(model.d.parameters(), lr=self.cfg.lr_d, betas=betas)
        g = torch.optim.Adam(model.g.parameters(), lr=self.cfg.lr_g, betas=betas)
        return {"D": OptimizerSpec(d), "G": OptimizerSpec(g)}

    def train_step(self, model, batch, optimizers, ctx) -> TaskOutput:
        (real,) = batch
        z = torch.randn(len(real), self.cfg.nz, device=real.device)  # the rank's own stream
        fake = model.g(z)
        # (1) D: maximize log D(x) + log(1 - D(G(z)))
        out_real = model.d(real)
        loss_d = bce(out_real, True) + bce(model.d(fake.detach()), False)
        optimizers.backward(loss_d, "D")
        optimizers.step("D")
        # (2) G: maximize log D(G(z)), through the updated D
        out_fake = model.d(fake)
        loss_g = bce(out_fake, True)
        optimizers.backward(loss_g, "G")
        optimizers.step("G")
        return TaskOutput(
            loss=(loss_d + loss_g).detach(),
            samples=len(real),
            metrics={
                "Loss_D": loss_d.detach(),
                "Loss_G": loss_g.detach(),
                "D(x)": torch.sigmoid(out_real).mean().detach(),
                "D(G(z))": torch.sigmoid(out_fake).mean().detach(),
            },
        )

    def compute(self, model, batch) -> TaskOutput:
        """D's loss on real points and on the generator's: used by eval sets (none here) and
        by the engine's FLOPs count, not by training (``train_step`` replaces it)."""
        (real,) = batch
        fake = model.g(torch.randn(len(real), self.cfg.nz, device=real.device))
        loss = bce(model.d(real), True) + bce(model.d(fake), False)
        return TaskOutput(loss=loss, samples=len(real))

    def on_epoch_end(self, model, ctx):
        if ctx.rank != 0:  # every rank holds the same generator: one writes
            return
        with torch.no_grad():
            points = model.g(self.fixed_noise.to(ctx.device)).cpu()
        path = ctx.task_dir / f"samples-epoch-{ctx.epoch:03d}.csv"
        path.write_text("x,y\n" + "".join(f"{x:.5f},{y:.5f}\n" for x, y in points.tolist()))
        ctx.log(f"epoch {ctx.epoch}: {len(points)} generated points in {path.name}")

    def export_modules(self) -> dict[str, str]:
        return {"G": "g", "D": "d"}
