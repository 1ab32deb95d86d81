"""Sharded, resumable data loading.

The position in the data is (epoch, samples the whole run consumed in that epoch): each
epoch's order is a permutation drawn from ``data.seed + epoch``, and the ranks take it in
turns (rank r the samples at r, r + world, ...), so what every rank consumed together is
always a prefix of that permutation. A resumed run rebuilds the same order and deals out
what follows the prefix, with no generator state to carry, whatever its world size and
batch size: no sample of the epoch is skipped or repeated (the epoch's ragged tail, fewer
samples than one batch on every rank, is dropped as always). With the same world and batch
it is the very same split, batch for batch.
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
    samples: int = 0  # of the epoch's order, consumed by all ranks together

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.samples}

    @classmethod
    def from_state(cls, state: dict, world_size: int, batch_size: int) -> DataPosition:
        """A checkpoint's position; before samples were kept it held this rank's micro-batches
        (``batch``), from a run of ``world_size`` ranks and ``batch_size`` samples each."""
        if "samples" in state:
            return cls(int(state["epoch"]), int(state["samples"]))
        return cls(int(state["epoch"]), int(state["batch"]) * batch_size * world_size)


class ShardSampler(Sampler[int]):
    """This rank's share of a seeded per-epoch permutation, from a given sample onwards."""

    def __init__(self, n: int, rank: int, world: int, batch_size: int, seed: int, shuffle: bool):
        self.n, self.rank, self.world = n, rank, world
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch = 0
        self.start = 0  # samples of the epoch's order already consumed by all ranks
        self.per_rank = self._per_rank()

    def _per_rank(self) -> int:
        """Samples this rank takes from ``start`` to the epoch's end."""
        if not self.shuffle:
            return -(-self.n // self.world)
        # Training drops the ragged tail so every rank takes the same number of steps.
        return ((self.n - self.start) // self.world) // self.batch_size * self.batch_size

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start
        self.per_rank = self._per_rank()

    def batches_per_epoch(self) -> int:
        """Whole batches per rank in a training epoch read from its start."""
        return (self.n // self.world) // self.batch_size

    def indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        first = self.start + self.rank
        return order[first : self.start + self.world * self.per_rank : self.world].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        if self.shuffle:
            return max(0, self.per_rank)
        return len(range(self.start + self.rank, self.n, self.world))


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
        self._step = self.sampler.batch_size * self.sampler.world  # samples per micro-batch

    def _start_epoch(self) -> None:
        self.sampler.set_position(self.position.epoch, self.position.samples)
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
        self.position.samples += self._step
        return batch
