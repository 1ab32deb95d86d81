"""``autoencoder3d``: a denoising 3D convolutional autoencoder on synthetic volumes.

Each volume holds one to ``max_ellipsoids`` solid ellipsoids of random centre, radii and
intensity; the input adds Gaussian noise, the target is the clean volume. The model halves
the resolution twice with strided 3D convolutions (BatchNorm3d after each: converted to
SyncBatchNorm with ``distributed.sync_batchnorm = true`` on GPUs) and brings it back with
transposed convolutions. The loss is the mean squared error; the metric, the PSNR against
the clean volume (peak 1), per volume and averaged. With ``slice_png`` each eval writes a
slice of the first held-out volume as a labelled PNG into the run's ``task/`` directory: the
noisy input, the reconstruction, the clean target and their difference, each with its value
range. The slice is the volume's with the most content (the largest sum of its clean
voxels), chosen once, so every eval shows the same one (a fixed middle slice is empty in
about one volume of five).

Written against the public task contract alone (tasks/base.py), as a user's task would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet
from .configs import Autoencoder3DConfig
from .slice_image import compose, write_png


def _down(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(c_in, c_out, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm3d(c_out),
        nn.ReLU(inplace=True),
    )


def _up(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.ConvTranspose3d(c_in, c_out, 4, stride=2, padding=1, bias=False),
        nn.BatchNorm3d(c_out),
        nn.ReLU(inplace=True),
    )


class Autoencoder3D(nn.Module):
    def __init__(self, c: Autoencoder3DConfig):
        super().__init__()
        w = c.channels
        self.encoder = nn.Sequential(
            _down(1, w), _down(w, 2 * w), nn.Conv3d(2 * w, c.latent_channels, 1)
        )
        self.decoder = nn.Sequential(
            _up(c.latent_channels, 2 * w), _up(2 * w, w), nn.Conv3d(w, 1, 3, padding=1)
        )

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        """(batch, 1, size, size, size) → the same shape."""
        return self.decoder(self.encoder(volume))


def make_volumes(
    c: Autoencoder3DConfig, n: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (noisy, clean) volumes of shape (n, 1, size, size, size), clean in [0, 1]."""
    s, k = c.size, c.max_ellipsoids
    axis = (torch.arange(s, dtype=torch.float32) + 0.5) / s
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).view(-1, 3)
    centres = 0.2 + 0.6 * torch.rand(n, k, 1, 3, generator=g)
    radii = 0.08 + 0.22 * torch.rand(n, k, 1, 3, generator=g)
    intensity = 0.3 + 0.7 * torch.rand(n, k, 1, generator=g)
    present = torch.arange(k) < torch.randint(1, k + 1, (n, 1), generator=g)  # 1..k of them
    inside = (((grid - centres) / radii) ** 2).sum(-1) <= 1.0  # (n, k, voxels)
    values = torch.where(inside & present[..., None], intensity, 0.0)
    clean = values.amax(dim=1).view(n, 1, s, s, s)  # where they overlap, the brighter one
    noisy = clean + c.noise * torch.randn(clean.shape, generator=g)
    return noisy, clean


def psnr(reconstruction: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """Per volume, in dB against a peak of 1 (a perfect one capped at 100 dB)."""
    mse = (reconstruction.float() - clean.float()).square().flatten(1).mean(1)
    return 10.0 * torch.log10(1.0 / mse.clamp_min(1e-10))


class Autoencoder3DTask:
    Config = Autoencoder3DConfig

    def __init__(self, config: Autoencoder3DConfig):
        self.cfg = config
        self._shown: tuple[torch.Tensor, torch.Tensor] | None = None  # the PNG's volume
        self.slice = 0  # the PNG's slice of it (along the first axis): the fullest

    def build_model(self) -> nn.Module:
        return Autoencoder3D(self.cfg)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one volume: 2 per multiply-add of every convolution forward, 3×
        that with the backward (the first convolution's input gradient is not needed, but
        is small). BatchNorm, ReLU and the loss are not counted."""
        c, s = self.cfg, self.cfg.size
        w, z = c.channels, c.latent_channels
        half, quarter = (s // 2) ** 3, (s // 4) ** 3
        macs = (
            half * w * 1 * 27  # 1 → w, stride 2
            + quarter * 2 * w * w * 27  # w → 2w, stride 2
            + quarter * z * 2 * w  # 1×1×1 to the code
            + half * 2 * w * z * 8  # transposed 4³ kernel, stride 2: 8 taps per output
            + s**3 * w * 2 * w * 8
            + s**3 * 1 * w * 27  # w → 1
        )
        return float(3 * 2 * macs)

    def build_datasets(self):
        c = self.cfg
        g = torch.Generator().manual_seed(c.data_seed)
        train = TensorSet(*make_volumes(c, c.train_samples, g))
        if not c.eval_samples:
            return train, None
        noisy, clean = make_volumes(c, c.eval_samples, g)
        self._shown = (noisy[:1], clean[:1])
        self.slice = fullest_slice(clean[0, 0])
        return train, TensorSet(noisy, clean)

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        noisy, clean = batch
        out = model(noisy)
        loss = F.mse_loss(out.float(), clean.float())
        return TaskOutput(
            loss=loss, samples=len(clean), metrics={"psnr": psnr(out.detach(), clean).mean()}
        )

    def on_eval_end(self, model: nn.Module, metrics, ctx) -> None:
        """The middle slice of one held-out volume as a PNG. Every rank makes the forward (a
        sharded model's needs every rank); rank 0 writes it."""
        if not self.cfg.slice_png or self._shown is None:
            return
        dtype = next(model.parameters()).dtype  # float64 under train.precision = "fp64"
        noisy, clean = (t.to(ctx.device, dtype) for t in self._shown)
        was_training = model.training
        model.eval()  # BatchNorm's running statistics: nothing of the run changes
        try:
            with torch.no_grad():
                out = model(noisy)
        finally:
            model.train(was_training)
        if ctx.rank != 0:
            return
        z, size = self.slice, self.cfg.size
        noisy_z, out_z, clean_z = (v[0, 0, z].float().cpu() for v in (noisy, out, clean))
        diff = out_z - clean_z
        spread = max(float(diff.abs().max()), 1e-6)
        image, _ = compose(
            f"step {ctx.step}: eval volume 0, slice {z + 1} of {size} (the fullest)",
            [
                ("input (noisy)", noisy_z, 0.0, 1.0),
                ("reconstruction", out_z, 0.0, 1.0),
                ("clean (target)", clean_z, 0.0, 1.0),
                ("recon - clean", diff, -spread, spread),
            ],
        )
        write_png(ctx.task_dir / f"slice-step-{ctx.step:08d}.png", image)


def fullest_slice(volume: torch.Tensor) -> int:
    """The index along the first axis of the slice of a (size, size, size) volume whose
    voxels sum highest."""
    return int(volume.flatten(1).sum(1).argmax())
