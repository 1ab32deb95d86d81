"""The training set against the batch: the one rule a launch, ``--dry-run`` and the ranks apply.

Training drops each rank's ragged tail (engine/data.py ``ShardSampler``), so an epoch has
``(samples // world) // batch_size`` whole batches per rank; none means no step can run.
With ``data.drop_last = false`` the tail is kept: every rank's share is ``ceil(samples /
world)`` (padded with repeats, as torch's DistributedSampler pads), its last batch smaller.
No torch here: the console applies the rule before anything is written.
"""

from __future__ import annotations


def batches_per_epoch(samples: int, world: int, batch_size: int, drop_last: bool = True) -> int:
    """Training batches per rank in one epoch (``drop_last``: whole ones only)."""
    if drop_last:
        return (samples // world) // batch_size
    share = -(-samples // world)
    return -(-share // batch_size)


def batch_problem(
    samples: int, world: int, batch_size: int | str, drop_last: bool = True
) -> str | None:
    """Why ``samples`` cannot give each of ``world`` ranks one batch (``data.batch_size``,
    ``"auto"``: at least one sample each), or None when they can."""
    least = 1 if batch_size == "auto" else batch_size
    if isinstance(least, int) and batches_per_epoch(samples, world, least, drop_last) == 0:
        return f"{samples} samples over {world} ranks is less than one batch"
    return None
