"""The step events: what each step adds to the window, and the event at a log step.

The numbers of a window (loss, samples, tokens, the task's train-time metrics) stay on the
device between log steps; on CPU, where a value is a host read and a tensor operation costs
more than the arithmetic, the window's loss sum is a host number (issue 26). At a log step
every rank's row rides with the gradients' all-reduce (exchange.py), filled before the last
micro-batch's backward; rank 0 then writes one ``step`` event from every rank's numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .exchange import Row
from .memory_watch import MemoryWatch
from .metrics import memory_sample
from .nonfinite import NonFiniteLoss

if TYPE_CHECKING:
    from ..profile import TrainConfig
    from ..tasks.base import TaskOutput
    from ..timings import Stopwatch
    from .compile import Compiled
    from .control import Control
    from .data import DataPosition
    from .distributed import Dist
    from .exchange import Exchange
    from .flops import MFU
    from .heartbeat import Beat
    from .optim_set import Optimizers
    from .reporter import Reporter
    from .train_metrics import TrainMetrics
    from .update_step import Update


@dataclass
class Window:
    """What happened since the last step event; kept on the device, synced at log time."""

    loss_sum: torch.Tensor | float  # a float on CPU
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy = "skip")
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Parts:
    """What a step event is made of, besides the ranks' rows."""

    out: Reporter
    d: Dist
    train: TrainConfig  # the profile's [train]
    opts: Optimizers
    exchange: Exchange
    control: Control  # a log step's row carries its proposal
    mfu: MFU
    watch: Stopwatch
    metrics: TrainMetrics
    compiled: Compiled
    beat: Beat
    memory: MemoryWatch  # a GPU nearly full, the allocator retrying: warnings


class StepLogger:
    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.window = self.new_window()

    def new_window(self, keep_skipped: bool = False) -> Window:
        """A fresh window (its clock starts now); ``keep_skipped``: after a pause, the updates
        skipped since the last log step are still to be counted at the next one."""
        skipped = self.window.skipped if keep_skipped else 0
        if self.p.d.device.type == "cpu":
            zero: torch.Tensor | float = 0.0
        else:
            dtype = torch.float64 if self.p.train.precision == "fp64" else torch.float32
            zero = torch.zeros((), dtype=dtype, device=self.p.d.device)
        self.window = Window(loss_sum=zero, skipped=skipped)
        return self.window

    def add_skipped(self, n: int) -> None:
        """Updates found skipped later than their step (a deferred verdict, nonfinite.py)."""
        self.window.skipped += n

    def micro_batch(
        self, result: TaskOutput, last_loss: torch.Tensor, fill_row: bool, step: int
    ) -> None:
        """A micro-batch's numbers; on a log step's last one (``fill_row``), this rank's row
        is filled before its backward (``step``: the steps completed)."""
        w, p = self.window, self.p
        w.samples += result.samples
        w.tokens += result.tokens
        p.metrics.add(result)
        if fill_row:
            p.exchange.prepare(
                [last_loss, self._with(last_loss)],
                [w.samples, w.tokens, *memory_sample(p.d.device)]
                + list(p.control.proposal(step + 1)),
                p.metrics.columns(),
            )

    def step_done(self, last_loss: torch.Tensor, skipped: int) -> None:
        self.window.loss_sum = self._with(last_loss)
        self.window.steps += 1
        self.window.skipped += skipped

    def _with(self, last_loss: torch.Tensor) -> torch.Tensor | float:
        """The window's loss sum with ``last_loss`` added (on CPU in host arithmetic)."""
        total = self.window.loss_sum
        return total + (last_loss if isinstance(total, torch.Tensor) else float(last_loss))

    def log(self, step: int, position: DataPosition, update: Update) -> list[Row]:
        """Collective: every rank's row, and rank 0's step event; a new window. Raises
        NonFiniteLoss when the loss is not finite under ``nan_policy = "stop"``."""
        self.p.beat.set(step, "sync")
        rows = self.p.exchange.gather()
        self.p.compiled.check(self.p.out.log)
        self.event(step, position, rows, update)
        self.new_window()
        self.p.metrics.reset()
        return rows

    def event(self, step: int, position: DataPosition, rows: list[Row], update: Update) -> None:
        """A step event from every rank's numbers, which came with the step's exchange."""
        p, w, world = self.p, self.window, self.p.d.world_size
        loss = sum(r.last_loss for r in rows) / world
        samples = sum(r.samples for r in rows)
        tokens = sum(r.tokens for r in rows)
        elapsed = max(time.perf_counter() - w.started, 1e-9)
        if not math.isfinite(loss) and p.train.nan_policy == "stop":
            first = step - w.steps + 1
            where = f"step {step}" if first == step else f"steps {first}-{step}"
            raise NonFiniteLoss(f"loss is {loss} in {where} (train.nan_policy = 'stop')")
        if not p.out.active:
            return
        p.memory.check(step, rows)
        lrs = p.opts.lrs()
        fields = {
            "step": step,
            "epoch": position.epoch,
            "loss": loss,
            "loss_avg": sum(r.loss_sum for r in rows) / world / max(w.steps, 1),
            "lr": lrs[p.opts.entries[0].name],
            "grad_norm": float(update.grad_norm),
            "samples_per_s": samples / elapsed,
            "step_time_s": elapsed / max(w.steps, 1),
            "memory": [
                {"rank": i, "allocated": r.allocated, "reserved": r.reserved, "peak": r.peak}
                | (  # a GPU's: its memory in use by every process, its total, the retries
                    {
                        "device_used": r.device_used,
                        "device_total": r.device_total,
                        "alloc_retries": r.alloc_retries,
                    }
                    if r.device_total
                    else {}
                )  # fmt: skip
                for i, r in enumerate(rows)
            ],
        }
        if len(lrs) > 1:  # several optimizers: each one's lr and gradient norm
            fields["lrs"] = lrs
            fields["grad_norms"] = {k: float(v) for k, v in update.grad_norms.items()}
        if tokens:
            fields["tokens_per_s"] = tokens / elapsed
        if (util := p.mfu.of(samples / elapsed)) is not None:
            fields["mfu"] = util
        if p.train.nan_policy == "skip":
            fields["skipped"] = w.skipped
        if metrics := p.metrics.reduced([r.extra for r in rows]):
            fields["metrics"] = metrics  # the task's, reduced as it declares (train_metrics.py)
        fields.update(p.compiled.step_fields())
        p.out.event("step", **fields, **p.watch.first_step_fields())  # the first: its timings
