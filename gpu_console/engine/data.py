"""Sharded, resumable data loading.

The position in the data is (epoch, batches consumed in that epoch): each epoch's order is
a permutation drawn from ``data.seed + epoch``, so a resumed run rebuilds the exact same
order and skips what it had consumed, with no generator state to carry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..profile import DataConfig
from ..tasks.base import TensorSet, batch_collate


@dataclass
class DataPosition:
    epoch: int = 0
    batch: int = 0  # micro-batches this rank consumed in the epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}


class ShardSampler(Sampler[int]):
    """This rank's share of a seeded per-epoch permutation, from a given batch onwards."""

    def __init__(self, n: int, rank: int, world: int, batch_size: int, seed: int, shuffle: bool):
        self.n, self.rank, self.world = n, rank, world
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch = 0
        self.start_batch = 0
        # Training drops the ragged tail so every rank takes the same number of steps.
        self.per_rank = (n // world) // batch_size * batch_size if shuffle else -(-n // world)

    def set_position(self, epoch: int, start_batch: int) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def batches_per_epoch(self) -> int:
        return self.per_rank // self.batch_size

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        shard = order[self.rank : self.world * self.per_rank : self.world]
        return shard[self.start_batch * self.batch_size :].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        mine = self.per_rank if self.shuffle else len(range(self.rank, self.n, self.world))
        return max(0, mine - self.start_batch * self.batch_size)


def make_loader(
    dataset: Dataset, cfg: DataConfig, rank: int, world: int, train: bool, cuda: bool
) -> DataLoader:
    sampler = ShardSampler(len(dataset), rank, world, cfg.batch_size, cfg.seed, shuffle=train)
    if train and sampler.batches_per_epoch() == 0:
        raise ValueError(
            f"data.batch_size: {len(dataset)} samples over {world} ranks is less than one batch "
            f"(got {cfg.batch_size})"
        )
    workers = cfg.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=train,
        collate_fn=batch_collate if isinstance(dataset, TensorSet) else None,
        num_workers=workers,
        pin_memory=cfg.pin_memory and cuda,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=cfg.persistent_workers and workers > 0,
        # A loader of its own: creating an iterator would otherwise draw from the global RNG
        # and a resumed run would diverge from an uninterrupted one.
        generator=torch.Generator().manual_seed(cfg.seed),
    )


class Batches:
    """Endless micro-batches across epochs, tracking the position for checkpoints."""

    def __init__(self, loader: DataLoader, position: DataPosition):
        self.loader = loader
        self.sampler: ShardSampler = loader.sampler  # type: ignore[assignment]
        self.position = position
        self._it: Iterator | None = None

    def _start_epoch(self) -> None:
        self.sampler.set_position(self.position.epoch, self.position.batch)
        self._it = iter(self.loader)

    def next(self):
        if self._it is None:
            self._start_epoch()
        try:
            batch = next(self._it)
        except StopIteration:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._start_epoch()
            batch = next(self._it)
        self.position.batch += 1
        return batch
