"""Time per epoch: an ``epoch`` event each time the train data completes an epoch.

The event (rank 0's, like every event) carries the epoch (from 0), the step that completed
it, ``seconds``: wall time from the epoch's first step in this session (or the session's first
step) to the end of the step that completed it, evals and checkpoints inside it included,
``steps`` in that time, and ``whole``: false for an epoch this session joined mid-way (a
resume) or did not time from its first batch, whose seconds are only this session's part.
The papers' "time per epoch" is the mean over whole epochs (summary.py, results/).
"""

from __future__ import annotations

import time

from .data import Batches
from .reporter import Reporter


class EpochClock:
    def __init__(self, out: Reporter, batches: Batches, step: int):
        self.out = out
        self.done = batches.epochs_done()
        # A session that starts mid-epoch (a resume) times only its part of that epoch.
        self.whole = batches.batch_in_epoch() == 0 or self.done > batches.position.epoch
        self.step = step
        self.t = time.monotonic()

    def begin(self) -> None:
        """The loop's first step starts now (start-up and an eval at start are not an
        epoch's)."""
        self.t = time.monotonic()

    def step_end(self, step: int, batches: Batches) -> None:
        done = batches.epochs_done()
        if done <= self.done:
            return
        now = time.monotonic()
        for epoch in range(self.done, done):  # several when an epoch is shorter than a step
            first = epoch == self.done
            self.out.event(
                "epoch",
                epoch=epoch,
                step=step,
                seconds=round(now - self.t, 6) if first else 0.0,
                steps=step - self.step if first else 0,
                whole=self.whole if first else False,
            )
        self.done, self.step, self.t, self.whole = done, step, now, True
