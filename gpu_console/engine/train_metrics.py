"""Train-time metrics: what a task's ``compute`` (or ``train_step``) returns in
``TaskOutput.metrics`` at training steps, reduced over the log window and the ranks.

Each rank keeps, per metric, two numbers on the device (no host sync per step): a
numerator and a weight. They ride in the log step's exchange table (exchange.py) as extra
columns, so the reduction costs no collective of its own. How each metric is reduced is
the task's to declare, in an optional ``metric_reduce`` (a dict, or a method returning
one) mapping a metric's name to:

- ``"mean_samples"`` (the default): the mean over every sample of the window, on every
  rank (each micro-batch's value weighted by its ``samples``);
- ``"mean_tokens"``: the same, weighted by each micro-batch's ``tokens``;
- ``"sum"``: each rank's mean over the window's micro-batches, summed over the ranks (a
  count each rank reports per step: the sum over the ranks, per step);
- ``"max"``: the largest value any rank returned in the window;
- ``"rank0"``: rank 0's mean over the window's micro-batches.

The metric names are agreed on at the first log step (every rank's, once, by one object
all-gather): every rank's table must have the same width. A name first returned later is
left out, with one warning.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

REDUCTIONS = ("mean_samples", "mean_tokens", "sum", "max", "rank0")
DEFAULT = "mean_samples"


class MetricReduceError(ValueError):
    """A task's ``metric_reduce`` names a reduction that does not exist."""


def declared(task) -> dict[str, str]:
    """The task's ``metric_reduce``, checked (an attribute or a method; absent: ``{}``)."""
    spec = getattr(task, "metric_reduce", None)
    if callable(spec):
        spec = spec()
    spec = dict(spec or {})
    for name, how in spec.items():
        if how not in REDUCTIONS:
            raise MetricReduceError(
                f"task.metric_reduce[{name!r}] = {how!r}: expected one of {', '.join(REDUCTIONS)}"
            )
    return spec


class TrainMetrics:
    """One rank's metrics over the current log window, and their reduction over the ranks."""

    def __init__(self, task, rank: int, world_size: int, device: torch.device, warn=None):
        self.reduce = declared(task)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.warn = warn or (lambda message: None)
        self.names: list[str] | None = None  # agreed at the first log step
        self._late: set[str] = set()
        self._num: dict[str, torch.Tensor] = {}
        self._weight: dict[str, torch.Tensor] = {}

    def how(self, name: str) -> str:
        return self.reduce.get(name, DEFAULT)

    def add(self, output) -> None:
        """One micro-batch's metrics, kept on the device."""
        for name, value in output.metrics.items():
            if self.names is not None and name not in self.names:
                if name not in self._late:
                    self._late.add(name)
                    self.warn(
                        f"train metric {name!r} first appeared after the first log step: "
                        "not reported"
                    )
                continue
            v = torch.as_tensor(value, device=self.device).detach().float().mean()
            how = self.how(name)
            if how == "mean_samples":
                v, w = v * output.samples, float(output.samples)
            elif how == "mean_tokens":
                v, w = v * output.tokens, float(output.tokens)
            else:
                w = 1.0
            if how == "max":
                old = self._num.get(name)
                self._num[name] = v if old is None else torch.maximum(old, v)
                self._weight[name] = torch.ones((), device=self.device)
            else:
                self._num[name] = self._num.get(name, 0.0) + v
                self._weight[name] = self._weight.get(name, 0.0) + torch.as_tensor(
                    w, device=self.device
                )

    def columns(self) -> list[torch.Tensor]:
        """This rank's extra exchange columns: (numerator, weight) per agreed name. The first
        call agrees on the names (collective: every rank calls it at the same log step)."""
        if self.names is None:
            self.names = self._agree(sorted(self._num))
        zero = torch.zeros((), device=self.device)
        out: list[torch.Tensor] = []
        for name in self.names:
            out += [self._num.get(name, zero), self._weight.get(name, zero)]
        return out

    def _agree(self, mine: list[str]) -> list[str]:
        if self.world_size == 1:
            return mine
        every: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return sorted({n for names in every for n in names or []})

    def reduced(self, extras: list[list[float]]) -> dict[str, float]:
        """The window's metrics from every rank's columns (``extras[rank]``)."""
        out: dict[str, float] = {}
        for i, name in enumerate(self.names or []):
            nums = [row[2 * i] for row in extras]
            weights = [row[2 * i + 1] for row in extras]
            how = self.how(name)
            if how in ("mean_samples", "mean_tokens"):
                if sum(weights) > 0:
                    out[name] = sum(nums) / sum(weights)
            elif how == "sum":
                present = [n / w for n, w in zip(nums, weights, strict=True) if w > 0]
                if present:
                    out[name] = sum(present)
            elif how == "max":
                present = [n for n, w in zip(nums, weights, strict=True) if w > 0]
                if present:
                    out[name] = max(present)
            elif weights[0] > 0:  # rank0
                out[name] = nums[0] / weights[0]
        return out

    def reset(self) -> None:
        """A new log window."""
        self._num, self._weight = {}, {}

    def describe(self) -> dict[str, Any]:
        return dict(self.reduce)
