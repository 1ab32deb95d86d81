"""The training set against the batch: the one rule a launch, ``--dry-run`` and the ranks apply.

Training drops each rank's ragged tail (engine/data.py ``ShardSampler``), so an epoch has
``(samples // world) // batch_size`` whole batches per rank; none means no step can run.
With ``data.drop_last = false`` the tail is kept: every rank's share is ``ceil(samples /
world)`` (padded with repeats, as torch's DistributedSampler pads), its last batch smaller.
No torch here: the console applies the rule before anything is written.
"""

from __future__ import annotations

from typing import Any

# A length in epochs and the same length in steps (profile.py: both given; here: epochs
# turned into steps).
IN_EPOCHS = {"max_epochs": "max_steps", "eval_every_epochs": "eval_every"}


def batches_per_epoch(samples: int, world: int, batch_size: int, drop_last: bool = True) -> int:
    """Training batches per rank in one epoch (``drop_last``: whole ones only)."""
    if drop_last:
        return (samples // world) // batch_size
    share = -(-samples // world)
    return -(-share // batch_size)


def epochs_in_steps(
    epochs: int, samples: int, world: int, batch_size: int, drop_last: bool, accum: int
) -> tuple[int, float]:
    """``epochs`` of ``samples`` as optimizer steps (rounded up: the last epoch is trained to
    its end), and the steps of one epoch (a fraction where ``accum`` does not divide it)."""
    batches = batches_per_epoch(samples, world, batch_size, drop_last)
    return -(-(epochs * batches) // accum), batches / accum


def batch_problem(
    samples: int, world: int, batch_size: int | str, drop_last: bool = True
) -> str | None:
    """Why ``samples`` cannot give each of ``world`` ranks one batch (``data.batch_size``,
    ``"auto"``: at least one sample each), or None when they can."""
    least = 1 if batch_size == "auto" else batch_size
    if isinstance(least, int) and batches_per_epoch(samples, world, least, drop_last) == 0:
        return f"{samples} samples over {world} ranks is less than one batch"
    return None


def epochs_to_steps(profile: Any, samples: int | None, world: int, bad) -> None:
    """``train.max_epochs`` and ``train.eval_every_epochs`` as steps for this world and batch
    (run.toml then holds the steps, and 0 epochs: a resume keeps the run's length). A note
    says what they became."""
    t, data = profile.train, profile.data
    wanted = [k for k in IN_EPOCHS if getattr(t, k)]
    if not wanted:
        return
    key = f"train.{wanted[0]}"
    if data.batch_size == "auto":
        raise bad(key, "needs a fixed data.batch_size (auto is searched after launch, so an "
                  "epoch's steps are not known before)", getattr(t, wanted[0]))  # fmt: skip
    if samples is None:
        raise bad(key, "the training set's size was not known before launch (its check did "
                  "not finish); give the length in steps", getattr(t, wanted[0]))  # fmt: skip
    size = (samples, world, data.batch_size, data.drop_last, t.grad_accum)
    steps, per_epoch = epochs_in_steps(t.max_epochs or 1, *size)
    accum = f" × {t.grad_accum} micro-batches" if t.grad_accum > 1 else ""
    where = (
        f"{per_epoch:,.4g} steps per epoch ({samples:,} samples over {world} ranks × "
        f"{data.batch_size} per batch{accum})"
    )
    if t.max_epochs:
        if t.warmup_steps > steps:
            raise bad("train.warmup_steps", f"must not exceed the {steps:,} steps of "
                      f"train.max_epochs = {t.max_epochs}", t.warmup_steps)  # fmt: skip
        profile.notes.append(f"train.max_epochs = {t.max_epochs}: {steps:,} steps; {where}")
        t.max_steps, t.max_epochs = steps, 0
    if t.eval_every_epochs:
        every = max(1, int(t.eval_every_epochs * per_epoch))
        profile.notes.append(
            f"train.eval_every_epochs = {t.eval_every_epochs}: an eval every {every:,} steps; "
            f"{where}"
        )
        t.eval_every, t.eval_every_epochs = every, 0
