"""The training set against the batch: the one rule a launch, ``--dry-run`` and the ranks apply.

Training drops each rank's ragged tail (engine/data.py ``ShardSampler``), so an epoch has
``(samples // world) // batch_size`` whole batches per rank; none means no step can run.
No torch here: the console applies the rule before anything is written.
"""

from __future__ import annotations


def batches_per_epoch(samples: int, world: int, batch_size: int) -> int:
    """Whole training batches per rank in one epoch."""
    return (samples // world) // batch_size


def batch_problem(samples: int, world: int, batch_size: int | str) -> str | None:
    """Why ``samples`` cannot give each of ``world`` ranks one batch (``data.batch_size``,
    ``"auto"``: at least one sample each), or None when they can."""
    least = 1 if batch_size == "auto" else batch_size
    if isinstance(least, int) and batches_per_epoch(samples, world, least) == 0:
        return f"{samples} samples over {world} ranks is less than one batch"
    return None
