"""Which steps log, evaluate and checkpoint, and which are boundaries where the host syncs."""

from __future__ import annotations

from . import checkpoint


class Cadence:
    def __init__(self, train, ckpt, control, evaluates: bool) -> None:
        self.train, self.ckpt, self.control = train, ckpt, control
        self.evaluating = evaluates  # the task has an eval set

    def logs(self, n: int) -> bool:
        """Step ``n`` writes a step event (every rank knows it beforehand)."""
        return n % self.train.log_every == 0 or n == self.train.max_steps

    def evaluates(self, n: int) -> bool:
        return bool(self.evaluating and self.train.eval_every and n % self.train.eval_every == 0)

    def checkpoints(self, n: int, improved: bool) -> str | None:
        """The reason of step ``n``'s checkpoint, if one is due."""
        return checkpoint.due(n, self.ckpt, self.train.max_steps, improved)

    def boundary(self, n: int) -> bool:
        """A step after which the host syncs anyway (log, control, eval, checkpoint)."""
        return (
            self.logs(n)
            or self.control.due(n)
            or self.evaluates(n)
            or bool(self.ckpt.every_steps and n % self.ckpt.every_steps == 0)
        )
