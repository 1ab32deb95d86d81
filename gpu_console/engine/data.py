"""Sharded, resumable data loading in the order the profile's ``data.order`` chooses.

The position in the data is (epoch, samples the whole run consumed in that epoch). With
``shuffle`` (``sequential`` is the same without the permutation) each epoch's order is a
permutation drawn from ``data.seed + epoch``, and the ranks take it in turns (rank r the
samples at r, r + world, ...), so what every rank consumed together is always a prefix of
that permutation. A resumed run rebuilds the same order and deals out what follows the
prefix, with no generator state to carry, whatever its world size and batch size: no sample
of the epoch is skipped or repeated (the epoch's ragged tail, fewer samples than one batch
on every rank, is dropped unless ``data.drop_last = false``: then it is dealt out too,
padded with the epoch's first samples to the same count on every rank, as torch's
DistributedSampler pads, so every rank's last batch of the epoch has the same size). With
the same world and batch it is the very same split, batch for batch. The stream orders
(``contiguous``: each rank's rows are consecutive slices of the data set, batchify's layout;
``random``: with replacement, a generator per batch) are functions of the batch index,
``samples // (world × batch)``: exact with the same world and batch size, and kept as that
index otherwise.

Random draws in the dataset (augmentations): with ``data.num_workers = 0`` they come from
the rank's own RNG stream, which checkpoints carry. In worker processes, the global RNGs
(torch, random, numpy) are seeded before each batch from (data.seed, rank, epoch, batch in
the epoch): every rank draws differently, and a batch's draws do not depend on which worker
fetches it or on when the iterator started, so a resumed run draws, batch for batch, what
the uninterrupted run drew (same world size and batch size; the worker count may differ).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ..batching import batch_problem, batches_per_epoch
from ..profile import DataConfig
from ..tasks.base import TensorSet, batch_collate
from . import precision
from .refusal import Refused


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


ORDERS = ("shuffle", "sequential", "contiguous", "random")


class ShardSampler(Sampler[int]):
    """This rank's share of an epoch's order (``data.order``), from a given sample onwards.

    Training (``train``) reads whole batches in the task's order; eval reads every sample
    once, in order, each rank every ``world``-th. ``start`` counts the samples of the epoch
    all ranks consumed together; for the stream orders (contiguous, random) it is
    ``batches × world × batch_size``, so the batch index is ``start // (world × batch_size)``.
    """

    def __init__(
        self,
        n: int,
        rank: int,
        world: int,
        batch_size: int,
        seed: int,
        train: bool,
        order: str = "shuffle",
        keep_last: bool = False,
    ):
        if order not in ORDERS:
            raise ValueError(f"data.order: one of {', '.join(ORDERS)} (got {order!r})")
        self.n, self.rank, self.world = n, rank, world
        self.batch_size, self.seed, self.train = batch_size, seed, train
        self.order = order if train else "sequential"
        # data.drop_last = false (profile.py refuses it with the stream orders)
        self.keep_last = keep_last and train and self.order in ("shuffle", "sequential")
        self.epoch = 0
        self.start = 0  # samples of the epoch's order already consumed by all ranks
        self.per_rank = self._per_rank()

    def _per_rank(self) -> int:
        """Samples this rank takes from ``start`` to the epoch's end."""
        if not self.train:
            return -(-self.n // self.world)
        if self.order in ("contiguous", "random"):
            return max(0, self.batches_per_epoch() - self.start_batch) * self.batch_size
        if self.keep_last:  # the tail too, padded: every rank the same count
            return max(0, -(-(self.n - self.start) // self.world))
        # Training drops the ragged tail so every rank takes the same number of steps.
        return ((self.n - self.start) // self.world) // self.batch_size * self.batch_size

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start
        self.per_rank = self._per_rank()

    @property
    def start_batch(self) -> int:
        """The batch of the epoch (each rank's count) that ``start`` falls on: it keys the
        worker seeds, exactly so where world and batch size are unchanged since ``start``."""
        return self.start // (self.world * self.batch_size)

    def batches_per_epoch(self) -> int:
        """Batches per rank in a training epoch read from its start."""
        return batches_per_epoch(self.n, self.world, self.batch_size, not self.keep_last)

    def _streams(self) -> Iterator[int]:
        """Contiguous: the data set cut into ``world × batch_size`` streams of ``L`` samples,
        rank r's row j the stream ``r × batch_size + j``; batch k holds sample k of each of
        the rank's streams. Random: each batch ``batch_size`` indices drawn with replacement
        from a generator seeded by (data.seed, rank, epoch, batch)."""
        length = self.batches_per_epoch()
        rows = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        for k in range(self.start_batch, length):
            if self.order == "contiguous":
                yield from (row * length + k for row in rows)
            else:
                seed = batch_seed(self.seed, self.rank, ("random", self.epoch, k))
                g = torch.Generator().manual_seed(seed % 2**63)
                yield from torch.randint(self.n, (self.batch_size,), generator=g).tolist()

    def indices(self) -> list[int]:
        if self.order in ("contiguous", "random"):
            return list(self._streams())
        if self.order == "shuffle":
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        end = self.start + self.world * self.per_rank
        if self.keep_last and end > self.n:  # padded with the order's first samples
            order = order.repeat(-(-end // self.n))
        first = self.start + self.rank
        return order[first : end : self.world].tolist()

    def __iter__(self) -> Iterator[int]:
        if self.order in ("contiguous", "random"):
            return self._streams()  # lazily: a token file may hold millions of offsets
        return iter(self.indices())

    def __len__(self) -> int:
        if self.train:
            return max(0, self.per_rank)
        return len(range(self.start + self.rank, self.n, self.world))


class KeyedBatch(NamedTuple):
    """A batch's indices with where it is in the data, for the worker that fetches it."""

    key: tuple
    indices: list[int]


def batch_seed(seed: int, rank: int, key: tuple) -> int:
    """A 64-bit seed of (data.seed, rank, where the batch is), the same in every process."""
    digest = hashlib.blake2b(repr((seed, rank, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def seed_worker_rngs(seed: int) -> None:
    """About 40 µs: ``torch.manual_seed`` would take 0.4 ms seeding every backend's
    generator, and a worker draws from the CPU's alone (CUDA is no use in a forked worker)."""
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


class KeyedBatchSampler:
    """The sampler's indices in batches, each keyed by (epoch, batch) (eval: its batch)."""

    def __init__(self, sampler: ShardSampler, batch_size: int, drop_last: bool):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[KeyedBatch]:
        s = self.sampler
        where = ("train", s.epoch) if s.train else ("eval",)
        n, batch = s.start_batch, []
        for i in s:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield KeyedBatch((*where, n), batch)
                n, batch = n + 1, []
        if batch and not self.drop_last:
            yield KeyedBatch((*where, n), batch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class SeededFetch:
    """The task's dataset, fetched a batch at a time; in a worker, the RNGs seeded per batch."""

    def __init__(self, dataset: Dataset, seed: int, rank: int):
        self.dataset, self.seed, self.rank = dataset, seed, rank

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, batch: KeyedBatch | list[int]) -> Any:
        if isinstance(batch, KeyedBatch):
            if get_worker_info() is not None:  # the main process's RNGs are the rank's own
                seed_worker_rngs(batch_seed(self.seed, self.rank, batch.key))
            batch = batch.indices
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(batch) if getitems else [self.dataset[i] for i in batch]


def make_loader(
    dataset: Dataset,
    cfg: DataConfig,
    rank: int,
    world: int,
    train: bool,
    cuda: bool,
    collate: Callable[[Any], Any] | None = None,
    batch_size: int = 0,
    prec: str = "fp32",
) -> DataLoader:
    """``collate``: the task's ``collate(samples)`` if it has one (tasks/base.py).
    ``batch_size``: the eval's (``data.eval_batch_size``); 0 = ``data.batch_size``.
    ``prec``: the run's precision (fp64: the batches' floating tensors in float64)."""
    n = len(dataset)  # type: ignore[arg-type]
    size = batch_size or cfg.batch_size
    assert size != "auto", "data.batch_size = auto is chosen before any loader is made"
    sampler = ShardSampler(n, rank, world, size, cfg.seed, train, cfg.order, not cfg.drop_last)
    if train and (problem := batch_problem(n, world, size, cfg.drop_last)):
        # A launch judges it first; where it could not (a user task's data too slow to build
        # before launch), the ranks refuse it the same way (refusal.py).
        raise Refused("data.batch_size", f"{problem} (got {cfg.batch_size})")
    workers = cfg.num_workers
    return DataLoader(
        SeededFetch(dataset, cfg.seed, rank),  # type: ignore[arg-type]
        # torch's stubs want lists of indices; SeededFetch takes the keyed batches themselves
        batch_sampler=KeyedBatchSampler(sampler, size, drop_last=train and not sampler.keep_last),  # type: ignore[arg-type]
        collate_fn=precision.collate_in(prec, collate_of(dataset, collate)),
        num_workers=workers,
        pin_memory=cfg.pin_memory and cuda,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=cfg.persistent_workers and workers > 0,
        # A loader of its own: creating an iterator would otherwise draw from the global RNG
        # and a resumed run would diverge from an uninterrupted one.
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def collate_of(dataset: Dataset, collate: Callable[[Any], Any] | None) -> Callable | None:
    """The task's own collate, else a TensorSet's batch as is, else ``default_collate``."""
    if collate is not None:
        return collate
    return batch_collate if isinstance(dataset, TensorSet) else None


class Batches:
    """Endless micro-batches across epochs, tracking the position for checkpoints."""

    def __init__(self, loader: DataLoader, position: DataPosition):
        self.loader = loader
        self.sampler: ShardSampler = loader.batch_sampler.sampler  # type: ignore[union-attr]
        self.position = position
        self._it: Iterator | None = None
        self._step = self.sampler.batch_size * self.sampler.world  # samples per micro-batch

    def _start_epoch(self) -> None:
        self.sampler.set_position(self.position.epoch, self.position.samples)
        self._it = iter(self.loader)

    def next(self):
        if self._it is None:
            self._start_epoch()
        assert self._it is not None  # _start_epoch set it
        try:
            batch = next(self._it)
        except StopIteration:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._start_epoch()
            batch = next(self._it)
        self.position.samples += self._step
        return batch

    def batch_in_epoch(self) -> int:
        """The batches this rank has drawn in the position's epoch."""
        s = self.sampler
        return self.position.samples // (s.world * s.batch_size)

    def epochs_done(self) -> int:
        """Epochs the train data has completed: at an epoch's end (no whole batch left for
        every rank) that epoch counts, before the next draw moves the position on."""
        s, at = self.sampler, self.position
        if s.keep_last:
            return at.epoch + (at.samples >= s.n)
        return at.epoch + ((s.n - at.samples) // s.world < s.batch_size)


def move(batch: Any, device: torch.device) -> Any:
    """A batch on the device (tensors in lists, tuples and dicts too); on CPU as it is."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move(v, device) for k, v in batch.items()}
    return batch
