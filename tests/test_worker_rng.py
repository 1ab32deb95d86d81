"""Random draws in DataLoader workers: different on every rank, and a batch's draws the same
whichever worker fetches it and wherever the iterator started, so a resume repeats them."""

from __future__ import annotations

import random

import numpy as np
import torch
from conftest import events_of, only_run, task_profile
from harness import run_engine
from torch.utils.data import Dataset

from gpu_console.engine.data import Batches, DataPosition, make_loader
from gpu_console.profile import DataConfig


class Noisy(Dataset):
    """Sample i and a draw from each of the worker's global RNGs."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.tensor([i, torch.rand(()).item(), random.random(), np.random.rand()])


def draws(workers: int, rank: int = 0, start: DataPosition | None = None, batches: int = 12):
    cfg = DataConfig(batch_size=4, num_workers=workers, seed=3, persistent_workers=False)
    source = Batches(make_loader(Noisy(), cfg, rank, 2, True, False), start or DataPosition())
    return [source.next().tolist() for _ in range(batches)]


def test_each_batch_draws_the_same_whoever_fetches_it_and_wherever_the_loader_starts():
    full = draws(workers=2, batches=14)  # 5 batches an epoch: nearly three epochs
    assert draws(workers=1, batches=14) == full
    # From the middle of epoch 1 (an odd batch: the other worker takes it), as a resume does.
    # Batch 3 of epoch 1: 3 batches × 4 samples × 2 ranks consumed.
    assert draws(workers=2, start=DataPosition(1, samples=3 * 4 * 2), batches=6) == full[8:14]
    rows = [row for batch in full for row in batch]
    assert len({tuple(r[1:]) for r in rows}) == len(rows)  # every sample draws anew


def test_ranks_draw_differently():
    zero, one = draws(workers=2, rank=0), draws(workers=2, rank=1)
    assert all(
        a[1:] != b[1:] for x, y in zip(zero, one, strict=True) for a, b in zip(x, y, strict=True)
    )


def test_without_workers_torch_and_random_draws_are_the_ranks_own_stream():
    def main_process_draws():
        return [r[1:3] for b in draws(workers=0, batches=3) for r in b]

    torch.manual_seed(7)
    random.seed(7)
    first = main_process_draws()
    torch.manual_seed(7)
    random.seed(7)
    assert main_process_draws() == first  # the streams a checkpoint carries decide them
    torch.manual_seed(8)
    random.seed(8)
    assert main_process_draws() != first


# Each sample draws torch.rand in __getitem__ (in one of 2 workers); compute writes the batch's
# draws, one line per micro-batch, to DRAWS_DIR/rank<r>.txt.
DRAWING_TASK = """
import os

import torch
from torch.utils.data import Dataset

from gpu_console.tasks.mlp import MLPTask


class Noisy(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], torch.rand(())


class Drawing(MLPTask):
    def build_datasets(self):
        train, _ = super().build_datasets()
        return Noisy(*train.tensors), None

    def compute(self, model, batch):
        x, y, noise = batch
        path = os.path.join(os.environ["DRAWS_DIR"], f"rank{os.environ['RANK']}.txt")
        with open(path, "a") as f:
            f.write(" ".join(repr(v) for v in noise.tolist()) + "\\n")
        return super().compute(model, (x, y))
"""

# 256 samples, 2 ranks, batch 32: 4 batches a rank per epoch; 12 steps are 3 epochs.
WORKERS = ("data.num_workers=2", "task.train_samples=256")


def run_drawing(tmp_path, runs_dir, draws_dir, profile, *sets: str, resume=None):
    """The run's engine on two ranks (the harness: DataLoader workers forked from each rank,
    as under torchrun) and each rank's lines of draws."""
    draws_dir.mkdir(exist_ok=True)
    run_engine(tmp_path, profile, *WORKERS, *sets, ranks=2, runs_dir=runs_dir, resume=resume,
               env={"DRAWS_DIR": str(draws_dir)})  # fmt: skip
    return [(draws_dir / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]


def test_two_ranks_with_two_workers_draw_differently_and_a_resume_repeats_the_draws(tmp_path):
    profile = task_profile(tmp_path, "drawing", DRAWING_TASK, "Drawing", max_steps=12, ranks=2)
    runs_dir = tmp_path / "runs"
    reference = run_drawing(tmp_path, runs_dir / "ref", tmp_path / "ref", profile)
    assert [len(lines) for lines in reference] == [12, 12]
    assert all(a != b for a, b in zip(*reference, strict=True)), "ranks drew the same"
    epochs = [reference[0][e * 4 : e * 4 + 4] for e in range(3)]
    assert len({v for lines in epochs for line in lines for v in line.split()}) == 12 * 32

    # Ended at step 5 (the middle of epoch 1, an odd batch), then resumed to step 12.
    draws_dir = tmp_path / "resumed"
    first = run_drawing(tmp_path, runs_dir / "split", draws_dir, profile, "train.max_steps=5")
    assert [len(lines) for lines in first] == [5, 5]
    run = only_run(runs_dir / "split")
    both = run_drawing(tmp_path, runs_dir / "split", draws_dir, None, "train.max_steps=12",
                       resume=run)  # fmt: skip
    assert events_of(run, "start")[1]["start_step"] == 5
    # Bit for bit: the draws after the resume point are the uninterrupted run's.
    assert both == reference
