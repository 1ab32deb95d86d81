"""``data.drop_last = false``: training keeps each epoch's ragged tail. Every rank takes
``ceil(samples / world)`` of the epoch (padded with the epoch's first samples, as torch's
DistributedSampler pads), so every rank's last batch of the epoch has the same, smaller size.
The sampler on its own, then the engine on 2 ranks (the harness, tests/harness.py), resumed
across the tail."""

from __future__ import annotations

import pytest
from conftest import events_of, only_run, task_profile
from harness import run_engine

from gpu_console.batching import batch_problem, batches_per_epoch
from gpu_console.engine.data import Batches, DataPosition, make_loader
from gpu_console.profile import DataConfig, ProfileError, load_profile
from gpu_console.tasks.base import TensorSet

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def loaders(n: int, world: int, batch: int, **cfg):
    import torch

    data = TensorSet(torch.arange(n))
    c = DataConfig(batch_size=batch, **cfg)
    return [make_loader(data, c, r, world, True, False) for r in range(world)]


@pytest.mark.parametrize("order", ["shuffle", "sequential"])
@pytest.mark.parametrize("n", [70, 71])
def test_every_sample_of_the_epoch_is_dealt_and_every_rank_ends_on_the_same_short_batch(n, order):
    ranks = loaders(n, 2, 8, drop_last=False, order=order)
    sizes = [[len(b[0]) for b in loader] for loader in ranks]
    share = -(-n // 2)  # 35 or 36
    assert sizes[0] == sizes[1] == [8, 8, 8, 8, share - 32]
    seen = [int(i) for loader in ranks for b in loader for i in b[0]]
    assert sorted(set(seen)) == list(range(n)), "no sample of the epoch left out"
    assert len(seen) == 2 * share, "padded by as many repeats as the split needs, no more"
    assert batches_per_epoch(n, 2, 8, drop_last=False) == len(ranks[0]) == 5
    # The default drops the tail: 4 whole batches each, 64 of the samples.
    kept = loaders(n, 2, 8)
    assert [len(b[0]) for b in kept[0]] == [8, 8, 8, 8]


def test_the_epoch_counts_as_done_only_after_its_short_batch():
    (loader,) = loaders(20, 1, 8, drop_last=False)
    batches = Batches(loader, DataPosition())
    done = []
    for _ in range(4):
        batches.next()
        done.append(batches.epochs_done())
    assert done == [0, 0, 1, 1], "8, 8, then the 4 left close the epoch; the next is epoch 1's"


def test_fewer_samples_than_a_batch_can_still_train_without_drop_last():
    assert batch_problem(10, 2, 8) == "10 samples over 2 ranks is less than one batch"
    assert batch_problem(10, 2, 8, drop_last=False) is None


def test_the_stream_orders_refuse_it_in_one_line():
    with pytest.raises(ProfileError) as info:
        load_profile("quickstart", ["data.drop_last=false", "data.order=contiguous"])
    assert "data.drop_last: false needs data.order = 'shuffle' or 'sequential'" in str(info.value)


# The MLP, each step's batch size per rank as a train metric (averaged over the ranks).
SIZED = """
from gpu_console.tasks.mlp import MLPTask


class Sized(MLPTask):
    def compute(self, model, batch):
        out = super().compute(model, batch)
        out.metrics["n"] = float(len(batch[1]))
        return out
"""

SETS = ["task.train_samples=70", "data.batch_size=8", "data.drop_last=false",
        "train.schedule=constant", "train.eval_every=0"]  # fmt: skip


def test_a_run_trains_on_the_short_batch_and_resumes_across_it(tmp_path):
    profile = task_profile(tmp_path, "sized", SIZED, "Sized", max_steps=12, ranks=2)

    def run(runs: str, *more: str) -> list[dict]:
        done = run_engine(tmp_path, profile, *SETS, *more, ranks=2, runs_dir=tmp_path / runs)
        return events_of(done, "step")

    whole = run("whole")
    assert [e["metrics"]["n"] for e in whole] == [8, 8, 8, 8, 3] * 2 + [8, 8]
    assert [e["epoch"] for e in whole] == [0] * 5 + [1] * 5 + [2] * 2
    # Stopped at step 5, just after epoch 0's short batch (the position then counts more
    # samples than the epoch has), then resumed to 12: the same steps.
    part = run("part", "train.max_steps=5")
    assert [e["loss"] for e in part] == [e["loss"] for e in whole[:5]]
    resumed_dir = only_run(tmp_path / "part")
    run_engine(tmp_path, None, "train.max_steps=12", ranks=2, resume=resumed_dir,
               runs_dir=tmp_path / "part")  # fmt: skip
    after = [e for e in events_of(resumed_dir, "step") if e["step"] > 5]
    assert [e["metrics"]["n"] for e in after] == [8, 8, 8, 8, 3, 8, 8]
    assert [e["loss"] for e in after] == [e["loss"] for e in whole[5:]]
