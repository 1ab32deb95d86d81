"""data.order: each training order's layout, and a stop + resume on 2 ranks (the engine
harness, tests/harness.py) that reads, batch for batch, what the uninterrupted run read; a
task's own collate."""

from __future__ import annotations

import pytest
import torch
from conftest import events_of, only_run, task_profile
from harness import run_engine

from gpu_console.engine.data import Batches, DataPosition, ShardSampler, make_loader
from gpu_console.profile import DataConfig
from gpu_console.tasks.base import TensorSet

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def batches(order: str, n: int, rank: int, world: int, bs: int, count: int, seed: int = 0):
    cfg = DataConfig(batch_size=bs, order=order, seed=seed)
    source = Batches(make_loader(TensorSet(torch.arange(n)), cfg, rank, world, True, False),
                     DataPosition())  # fmt: skip
    return [source.next()[0].tolist() for _ in range(count)]


def test_sequential_deals_the_data_in_order_to_the_ranks_in_turn():
    assert batches("sequential", 20, 0, 2, 2, 3) == [[0, 2], [4, 6], [8, 10]]
    assert batches("sequential", 20, 1, 2, 2, 3) == [[1, 3], [5, 7], [9, 11]]
    # The next epoch is the same order again (the ragged tail dropped: 5 batches of 2 × 2).
    assert batches("sequential", 20, 0, 2, 2, 6)[5] == [0, 2]


def test_contiguous_gives_each_row_of_a_rank_its_own_stream_read_in_order():
    # 26 samples, 2 ranks × 3 rows: 6 streams of 4 (the last 2 samples dropped, as batchify).
    zero = batches("contiguous", 26, 0, 2, 3, 5)
    one = batches("contiguous", 26, 1, 2, 3, 4)
    assert zero[:4] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert one == [[12, 16, 20], [13, 17, 21], [14, 18, 22], [15, 19, 23]]
    assert zero[4] == [0, 4, 8]  # a new epoch starts every stream again


def test_random_draws_with_replacement_per_rank_and_batch_reproducibly():
    a = batches("random", 16, 0, 2, 8, 6, seed=5)
    assert a == batches("random", 16, 0, 2, 8, 6, seed=5)
    assert a != batches("random", 16, 1, 2, 8, 6, seed=5)
    assert a != batches("random", 16, 0, 2, 8, 6, seed=6)
    assert any(len(set(b)) < len(b) for b in a)  # 8 draws of 16: repeats are near certain
    assert all(0 <= i < 16 for b in a for i in b)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("order", ["shuffle", "sequential", "contiguous", "random"])
def test_every_order_resumes_at_the_exact_batch(order, workers):
    full = batches(order, 40, 1, 2, 4, 12)  # 5 batches an epoch
    cfg = DataConfig(batch_size=4, order=order, num_workers=workers, persistent_workers=False)
    loader = make_loader(TensorSet(torch.arange(40)), cfg, 1, 2, True, False)
    source = Batches(loader, DataPosition(1, samples=2 * 4 * 2))  # batch 2 of epoch 1
    assert [source.next()[0].tolist() for _ in range(5)] == full[7:12]


def test_an_unknown_order_is_named():
    with pytest.raises(ValueError, match=r"^data\.order: "):
        ShardSampler(10, 0, 1, 2, 0, True, "backwards")


class Pairs:
    """A dataset whose __getitems__ returns a dict of stacked tensors (a ready batch)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"x": torch.tensor(i)}

    def __getitems__(self, indices):
        return {"x": torch.tensor(indices), "n": len(indices)}


def test_a_task_collate_gets_the_batch_its_dataset_returns():
    cfg = DataConfig(batch_size=3, order="sequential")
    seen = []

    def collate(batch):
        seen.append(batch)
        return batch["x"] * 10

    loader = make_loader(Pairs(), cfg, 0, 1, True, False, collate)
    assert next(iter(loader)).tolist() == [0, 10, 20]
    assert seen[0]["n"] == 3
    # Without one, default_collate takes what __getitems__ returned for a list of samples.
    with pytest.raises(KeyError):
        next(iter(make_loader(Pairs(), cfg, 0, 1, True, False)))


# Each batch carries its sample indices (TensorSet's __getitems__ plus the indices, through
# the task's collate); compute writes them, one line per micro-batch, to DRAWS_DIR/rank<r>.txt.
INDEXED_TASK = """
import os

import torch

from gpu_console.tasks.base import TensorSet
from gpu_console.tasks.mlp import MLPTask


class Indexed(TensorSet):
    def __getitems__(self, indices):
        return (*super().__getitems__(indices), torch.as_tensor(indices))


class Reading(MLPTask):
    def build_datasets(self):
        train, _ = super().build_datasets()
        return Indexed(*train.tensors), None

    def collate(self, batch):
        return batch

    def compute(self, model, batch):
        x, y, idx = batch
        path = os.path.join(os.environ["DRAWS_DIR"], f"rank{os.environ['RANK']}.txt")
        with open(path, "a") as f:
            f.write(" ".join(map(str, idx.tolist())) + "\\n")
        return super().compute(model, (x, y))
"""


def run_reading(tmp_path, runs_dir, draws_dir, order, profile, *sets: str, resume=None):
    """A 2-rank run of the reading task (or a resume of ``resume``): what each rank read."""
    draws_dir.mkdir(exist_ok=True)
    run_engine(
        tmp_path, profile, f"data.order={order}", "task.train_samples=256",
        "train.lr_decay_steps=10", *sets, ranks=2, resume=resume, runs_dir=runs_dir,
        env={"DRAWS_DIR": str(draws_dir)},
    )  # fmt: skip
    return [(draws_dir / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]


def losses(run):
    return [e["loss"] for e in events_of(run, "step")]


@pytest.mark.parametrize("order", ["shuffle", "sequential", "contiguous", "random"])
def test_two_ranks_stopped_and_resumed_read_what_an_uninterrupted_run_reads(tmp_path, order):
    # 256 samples, 2 ranks, batch 32: 4 batches a rank per epoch; 10 steps are 2.5 epochs.
    profile = task_profile(tmp_path, "reading", INDEXED_TASK, "Reading", max_steps=10, ranks=2)
    runs_dir = tmp_path / "runs"
    ref_dir = runs_dir / "ref"
    reference = run_reading(tmp_path, ref_dir, tmp_path / "ref", order, profile)
    assert [len(lines) for lines in reference] == [10, 10]
    assert reference[0] != reference[1]

    draws_dir = tmp_path / "resumed"
    split = runs_dir / "split"
    run_reading(tmp_path, split, draws_dir, order, profile, "train.max_steps=5")
    run = only_run(split)
    both = run_reading(tmp_path, split, draws_dir, order, None, "train.max_steps=10", resume=run)
    assert events_of(run, "start")[1]["start_step"] == 5
    assert both == reference  # batch for batch, on both ranks
    assert losses(run)[-5:] == losses(only_run(ref_dir))[-5:]  # and bit for bit
