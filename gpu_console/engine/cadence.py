"""Which steps log, evaluate and checkpoint, and which are boundaries where the host syncs."""

from __future__ import annotations

import math

from . import checkpoint


def end_step(train) -> float:
    """The run's last step: ``train.max_steps``, or never (``max_steps = 0``: until stopped)."""
    return train.max_steps or math.inf


class Cadence:
    def __init__(self, train, ckpt, control, evaluates: bool) -> None:
        self.train, self.ckpt, self.control = train, ckpt, control
        self.evaluating = evaluates  # the task has an eval set
        self.eval_at = frozenset(train.eval_at)  # train.eval_at: explicit points

    def logs(self, n: int) -> bool:
        """Step ``n`` writes a step event (every rank knows it beforehand)."""
        return n % self.train.log_every == 0 or n == self.train.max_steps

    def evaluates(self, n: int) -> bool:
        """Step ``n`` ends with an eval: every ``eval_every`` steps, and at ``eval_at``'s."""
        every = self.train.eval_every
        return self.evaluating and (bool(every and n % every == 0) or n in self.eval_at)

    def checkpoints(self, n: int, improved: bool, last: bool = False) -> str | None:
        """The reason of step ``n``'s checkpoint, if one is due; ``last``: the run ends at
        ``n`` before max_steps (early stopping), so its end checkpoint is this step's."""
        return checkpoint.due(n, self.ckpt, n if last else end_step(self.train), improved)

    def boundary(self, n: int) -> bool:
        """A step after which the host syncs anyway (log, control, eval, checkpoint)."""
        return (
            self.logs(n)
            or self.control.due(n)
            or self.evaluates(n)
            or bool(self.ckpt.every_steps and n % self.ckpt.every_steps == 0)
        )
