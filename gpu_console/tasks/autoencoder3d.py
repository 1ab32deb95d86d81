"""``autoencoder3d``: a denoising 3D convolutional autoencoder on synthetic volumes, or on
yours (``task.data_dir``, below).

Each volume holds one to ``max_ellipsoids`` solid ellipsoids of random centre, radii and
intensity; the input adds Gaussian noise, the target is the clean volume. The model halves
the resolution twice with strided 3D convolutions (BatchNorm3d after each: SyncBatchNorm
on several CUDA ranks, ``distributed.sync_batchnorm = "auto"``) and brings it back with
transposed convolutions. The loss is the mean squared error; the metric, the PSNR against
the clean volume (peak 1), per volume and averaged. With ``slice_png`` each eval writes a
slice of the first held-out volume as a labelled PNG into the run's ``task/`` directory: the
noisy input, the reconstruction, the clean target and their difference, each with its value
range. The slice is the volume's with the most content (the largest sum of its clean
voxels), chosen once, so every eval shows the same one (a fixed middle slice is empty in
about one volume of five).

Real volumes (``task.data_dir``): a directory of ``.npy`` files, or NIfTI ``.nii``/``.nii.gz``
through nibabel, each one volume (the shapes volume_files.py accepts, several channels
included: the model's first and last convolutions take the files' channels). The console
judges every file's header before launch; the ranks read the voxels of the volumes a batch
needs (``.npy`` memory-mapped), normalise each per channel (``normalize``), add the noise
(``noise``: a fresh draw per training fetch, a fixed one per held-out volume) and, with
``flip``, flip a training volume along each spatial axis with probability 1/2 (the draws are
the engine's data RNG: a resumed run draws what the whole run drew). The held-out split is
volume_files.py's, from ``data_seed``. Sharding is the engine's: every rank sees the whole
set of files and reads its share of each batch.

The blocks (``blocks``: the two downsampling and the two upsampling blocks) are the unit of
activation checkpointing; the engine keeps BatchNorm's running statistics as the forward
left them when it recomputes a block.

Written against the public task contract alone (tasks/base.py), as a user's task would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .base import TaskOutput, TensorSet
from .configs import Autoencoder3DConfig
from .slice_image import compose, write_png
from .volume_files import Volumes, is_nifti


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
    def __init__(self, c: Autoencoder3DConfig, in_channels: int = 1):
        super().__init__()
        w = c.channels
        self.encoder = nn.Sequential(
            _down(in_channels, w), _down(w, 2 * w), nn.Conv3d(2 * w, c.latent_channels, 1)
        )
        self.decoder = nn.Sequential(
            _up(c.latent_channels, 2 * w), _up(2 * w, w), nn.Conv3d(w, in_channels, 3, padding=1)
        )

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        """(batch, channels, D, H, W) → the same shape (each side a multiple of 4)."""
        return self.decoder(self.encoder(volume))

    def blocks(self) -> list[nn.Module]:
        """The downsampling and upsampling blocks (convolution, BatchNorm, ReLU each)."""
        return [self.encoder[0], self.encoder[1], self.decoder[0], self.decoder[1]]


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


def read_volume(path: Path) -> torch.Tensor:
    """A volume file's voxels as float32 (C, D, H, W) (volume_files.model_shape's layout)."""
    import numpy as np

    if is_nifti(path):
        import nibabel

        image: Any = nibabel.load(path)  # a NIfTI image (load's type names their base class)
        data = np.asarray(image.get_fdata(dtype=np.float32))
        data = np.moveaxis(data, -1, 0) if data.ndim == 4 else data[None]
    else:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
        data = data if data.ndim == 4 else data[None]
    return torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: writable, in memory


def normalized(volume: torch.Tensor, how: str) -> torch.Tensor:
    """Per channel of a (C, D, H, W) volume: ``minmax`` to [0, 1] (a constant channel: 0),
    ``zscore`` to mean 0 and std 1 (a constant channel: 0), or ``none``."""
    if how == "none":
        return volume
    flat = volume.flatten(1)
    if how == "minmax":
        lo = flat.amin(1)
        spread = flat.amax(1) - lo
        scale = torch.where(spread > 0, 1.0 / spread.clamp_min(1e-30), 0.0)
        return (volume - lo.view(-1, 1, 1, 1)) * scale.view(-1, 1, 1, 1)
    mean, std = flat.mean(1), flat.std(1, unbiased=False)
    scale = torch.where(std > 0, 1.0 / std.clamp_min(1e-30), 0.0)
    return (volume - mean.view(-1, 1, 1, 1)) * scale.view(-1, 1, 1, 1)


def flipped(noisy: torch.Tensor, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (batch, C, D, H, W) volume flipped along each spatial axis with probability 1/2,
    input and target alike; the draws from torch's global generator (the engine's data RNG,
    engine/data.py: carried by checkpoints, seeded per batch in workers)."""
    coins = torch.rand(len(clean), 3) < 0.5
    noisy, clean = noisy.clone(), clean.clone()
    for i, flips in enumerate(coins.tolist()):
        dims = [1 + axis for axis, flip in enumerate(flips) if flip]  # D, H, W of (C, D, H, W)
        if dims:
            noisy[i], clean[i] = noisy[i].flip(dims), clean[i].flip(dims)
    return noisy, clean


class Flipped(TensorSet):
    """Synthetic volumes with ``flip``: a :class:`TensorSet` whose batches are flipped."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        noisy, clean = self.__getitems__([i])
        return noisy[0], clean[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        return flipped(*super().__getitems__(indices))


class VolumeFiles(Dataset):
    """``task.data_dir``'s volumes as (noisy, clean) batches, read when a batch asks for them:
    normalised, noised (training: a fresh draw per fetch from the data RNG; eval: a fixed
    draw per volume, seeded by ``data_seed`` and its index) and, in training with ``flip``,
    flipped."""

    def __init__(self, files: tuple[Path, ...], c: Autoencoder3DConfig, train: bool):
        self.files, self.cfg, self.train = files, c, train

    def __len__(self) -> int:
        return len(self.files)

    def clean(self, i: int) -> torch.Tensor:
        return normalized(read_volume(self.files[i]), self.cfg.normalize)

    def noise(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if self.train:
            return torch.randn(like.shape)
        g = torch.Generator().manual_seed((self.cfg.data_seed * 1_000_003 + i) % 2**63)
        return torch.randn(like.shape, generator=g)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noisy, clean = self.__getitems__([i])
        return noisy[0], clean[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        clean = torch.stack([self.clean(i) for i in indices])
        noise = torch.stack([self.noise(i, clean[0]) for i in indices])
        noisy = clean + self.cfg.noise * noise
        if self.train and self.cfg.flip:
            return flipped(noisy, clean)
        return noisy, clean


class Autoencoder3DTask:
    Config = Autoencoder3DConfig

    def __init__(self, config: Autoencoder3DConfig):
        self.cfg = config
        self._shown: tuple[torch.Tensor, torch.Tensor] | None = None  # the PNG's volume
        self.slice = 0  # the PNG's slice of it (along the first axis): the fullest
        self._volumes: Volumes | None = None

    def volumes(self) -> Volumes | None:
        """``task.data_dir`` judged and split, once (from the rank's directory, the run's
        launch directory, where the console judged it before launch)."""
        if self._volumes is None and self.cfg.data_dir:
            self._volumes = self.cfg.volumes()
        return self._volumes

    def shape(self) -> tuple[int, int, int, int]:
        """(C, D, H, W) of every volume: the files', else the synthetic cube's."""
        found = self.volumes()
        return found.shape if found is not None else (1, *(self.cfg.size,) * 3)

    def build_model(self) -> nn.Module:
        return Autoencoder3D(self.cfg, in_channels=self.shape()[0])

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The unit of activation checkpointing: the down- and upsampling blocks."""
        return cast(Autoencoder3D, model).blocks()

    def collate(self, batch: Any) -> Any:
        """Both data sets fetch whole stacked batches (``__getitems__``)."""
        return batch

    def flops_per_sample(self) -> float:
        """Training FLOPs of one volume: 2 per multiply-add of every convolution forward, 3×
        that with the backward (the first convolution's input gradient is not needed, but
        is small). BatchNorm, ReLU and the loss are not counted."""
        c = self.cfg
        ch, d, h, wd = self.shape()
        voxels = d * h * wd
        w, z = c.channels, c.latent_channels
        half, quarter = voxels // 8, voxels // 64
        macs = (
            half * w * ch * 27  # channels → w, stride 2
            + quarter * 2 * w * w * 27  # w → 2w, stride 2
            + quarter * z * 2 * w  # 1×1×1 to the code
            + half * 2 * w * z * 8  # transposed 4³ kernel, stride 2: 8 taps per output
            + voxels * w * 2 * w * 8
            + voxels * ch * w * 27  # w → channels
        )
        return float(3 * 2 * macs)

    def build_datasets(self):
        c = self.cfg
        found = self.volumes()
        if found is not None:
            files = VolumeFiles(found.train, c, train=True)
            if not found.held_out:
                return files, None
            held = VolumeFiles(found.held_out, c, train=False)
            self._show(*held.__getitems__([0]))
            return files, held
        g = torch.Generator().manual_seed(c.data_seed)
        volumes = make_volumes(c, c.train_samples, g)
        train = Flipped(*volumes) if c.flip else TensorSet(*volumes)
        if not c.eval_samples:
            return train, None
        noisy, clean = make_volumes(c, c.eval_samples, g)
        self._show(noisy[:1], clean[:1])
        return train, TensorSet(noisy, clean)

    def _show(self, noisy: torch.Tensor, clean: torch.Tensor) -> None:
        """The PNG's volume (the first held-out one) and its fullest slice (channel 0)."""
        self._shown = (noisy, clean)
        self.slice = fullest_slice(clean[0, 0] - clean[0, 0].min())

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
        z, size = self.slice, clean.shape[2]
        noisy_z, out_z, clean_z = (v[0, 0, z].float().cpu() for v in (noisy, out, clean))
        diff = out_z - clean_z
        spread = max(float(diff.abs().max()), 1e-6)
        lo, hi = 0.0, 1.0  # synthetic volumes and minmax's: in [0, 1]
        if self.cfg.data_dir and self.cfg.normalize != "minmax":
            lo, hi = float(clean_z.min()), max(float(clean_z.max()), float(clean_z.min()) + 1e-6)
        image, _ = compose(
            f"step {ctx.step}: eval volume 0, slice {z + 1} of {size} (the fullest)",
            [
                ("input (noisy)", noisy_z, lo, hi),
                ("reconstruction", out_z, lo, hi),
                ("clean (target)", clean_z, lo, hi),
                ("recon - clean", diff, -spread, spread),
            ],
        )
        write_png(ctx.task_dir / f"slice-step-{ctx.step:08d}.png", image)


def fullest_slice(volume: torch.Tensor) -> int:
    """The index along the first axis of the slice of a (size, size, size) volume whose
    voxels sum highest."""
    return int(volume.flatten(1).sum(1).argmax())
