"""Train-time metrics: what a task's ``compute`` (or ``train_step``) returns in
``TaskOutput.metrics`` at training steps, reduced over the log window and the ranks.

Each rank keeps, per metric, two numbers on the device (no host sync per step; on CPU on the
host, where reading a value costs less than a tensor operation): a numerator and a weight.
They ride in the log step's exchange table (exchange.py) as extra columns, so the reduction
costs no collective of its own. How each metric is reduced is the task's to declare, in an
optional ``metric_reduce`` (a dict, or a method returning one) mapping a metric's name to:

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

REDUCTIONS = ("mean_samples", "mean_tokens", "sum", "max", "rank0")
_WEIGHT = {"mean_samples": "samples", "mean_tokens": "tokens"}  # what a value is weighted by
DEFAULT = "mean_samples"


class MetricReduceError(ValueError):
    """A task's ``metric_reduce`` names a reduction that does not exist."""


def declared(task: object) -> dict[str, str]:
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


@dataclass
class _Acc:
    """One metric's window on one rank: its numerator (a device tensor for tensor values, a
    host number for plain numbers; a maximum for ``max``) and its weight."""

    dev: torch.Tensor | None = None
    host: float | None = None
    weight: float = 0.0
    how: str = DEFAULT


def _max(a: float, b: float) -> float:
    """The larger, a NaN winning as under ``torch.maximum`` (``max()`` would drop it)."""
    return b if b > a or b != b else a


class TrainMetrics:
    """One rank's metrics over the current log window, and their reduction over the ranks."""

    def __init__(
        self,
        task: object,
        rank: int,
        world_size: int,
        device: torch.device,
        warn: Callable[[str], None] | None = None,
    ):
        self.reduce = declared(task)
        self.rank, self.world_size, self.device = rank, world_size, device
        # On a GPU a metric stays there until the log step (reading it would sync the host);
        # on CPU reading it costs less than the two tensor operations a step that keep it.
        self.on_device = device.type != "cpu"
        self.warn = warn or (lambda message: None)
        self.names: list[str] | None = None  # agreed at the first log step
        self._late: set[str] = set()
        self._acc: dict[str, _Acc] = {}  # this log window's, by name

    def how(self, name: str) -> str:
        return self.reduce.get(name, DEFAULT)

    def add(self, output) -> None:
        """One micro-batch's metrics: on a GPU tensors stay there and numbers on the host (a
        number copied to a GPU every step would sync the host); on CPU all are host numbers."""
        for name, value in output.metrics.items():
            acc = self._acc.get(name)
            if acc is None:  # the window's first value of this name
                if self.names is not None and name not in self.names:
                    self._left_out(name)
                    continue
                acc = self._acc[name] = _Acc(how=self.how(name))
            if isinstance(value, torch.Tensor) and self.on_device:
                value = value.detach().float()
                value = value if value.dim() == 0 else value.mean()
            elif isinstance(value, torch.Tensor):  # CPU: a host read, then host arithmetic
                value = float(value if value.dim() == 0 else value.detach().float().mean())
            else:
                value = float(value)
            how = acc.how
            weight = getattr(output, _WEIGHT[how]) if how in _WEIGHT else 1
            acc.weight += weight
            on_device = isinstance(value, torch.Tensor)
            if how == "max":
                if on_device:
                    acc.dev = value if acc.dev is None else torch.maximum(acc.dev, value)
                else:
                    acc.host = value if acc.host is None else _max(acc.host, value)
            else:
                value = value * weight if weight != 1 else value
                if on_device:
                    acc.dev = value if acc.dev is None else acc.dev + value
                else:
                    acc.host = value if acc.host is None else acc.host + value

    def _left_out(self, name: str) -> None:
        if name not in self._late:
            self._late.add(name)
            self.warn(
                f"train metric {name!r} first appeared after the first log step: not reported"
            )

    def columns(self) -> list[torch.Tensor | float]:
        """This rank's extra exchange columns: (numerator, weight) per agreed name. The first
        call agrees on the names (collective: every rank calls it at the same log step)."""
        if self.names is None:
            self.names = self._agree(sorted(self._acc))
        if not self.names:
            return []
        accs = [self._acc.get(name, _Acc()) for name in self.names]
        if not self.on_device:  # CPU: every numerator is a host number already
            return [x for a in accs for x in (0.0 if a.host is None else a.host, a.weight)]
        # The host's numbers in one copy (pinned and asynchronous on a GPU, as exchange.py's).
        host = [a.weight for a in accs] + [a.host if a.host is not None else 0.0 for a in accs]
        host_t = torch.tensor(host, dtype=torch.float32)
        if self.device.type == "cuda":
            host_t = host_t.pin_memory().to(self.device, non_blocking=True)
        host_t = host_t.to(self.device)
        n = len(accs)
        out: list[torch.Tensor | float] = []
        for i, (name, a) in enumerate(zip(self.names, accs, strict=True)):
            num = host_t[n + i]
            if a.dev is not None:
                if a.host is None:
                    num = a.dev
                elif self.how(name) == "max":
                    num = torch.maximum(a.dev, num)
                else:
                    num = a.dev + num
            out += [num, host_t[i]]
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
        self._acc = {}

    def describe(self) -> dict[str, Any]:
        return dict(self.reduce)
