"""``train.nan_policy``'s check of each update, without a host sync per step on GPUs.

The gradient norm (of the all-reduced gradients: the same on every rank) decides whether an
update is made. On CPU the loop reads it every step, which costs nothing there. On a GPU,
reading it is a device→host sync that drains the GPU's queue every step: the host can no
longer run ahead, and each step starts with the GPU idle while the first kernels are
launched. So there, with the fused AdamW (``train.optimizer_impl = "auto"`` on CUDA) and no
GradScaler, the verdict gates the update **on the device**: the optimizer's ``found_inf``
makes the fused kernel leave the parameters, moments and step count untouched, exactly as
if the update had not been called. The host reads the verdicts of the steps since the last
look at the next *boundary*, a step where it syncs anyway: a log step, a control check,
eval, a checkpoint, the last step.

- ``skip``: the CPU semantics exactly (the bad update is not made, the schedule moves on);
  the skipped count reaches the step event of the next log step.
- ``stop``: the first non-finite norm latches: every later update is gated too, so the
  weights and moments stay those of the last finite step. At the boundary the loop rewinds
  the step count and the lr schedule to that step and stops as on CPU
  (checkpoint ``nan`` of the last finite state, the message naming the first bad step).
  The trade-off: up to a log interval of steps computed for nothing before the stop, and
  the checkpoint's RNG states are those of the boundary, not of the last finite step.

``GPU_CONSOLE_NONFINITE_CHECK`` overrides the choice: ``each-step`` (read the verdict every
step, as on CPU) or ``deferred`` (gate on the device wherever the optimizer is fused, CPU
included: the tests run the deferred path through real torchrun that way).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import torch_private

if TYPE_CHECKING:
    from .data import DataPosition

ENV = "GPU_CONSOLE_NONFINITE_CHECK"


class NonFiniteLoss(RuntimeError):
    """``nan_policy = "stop"`` tripped: every rank stops at the same step (nan_stop.py)."""


@dataclass
class Trip:
    """The first non-finite update of a ``stop`` run, found at a boundary."""

    steps_back: int  # how many steps before the boundary's the last finite one is
    loss: torch.Tensor  # the bad step's loss (this rank's part)
    norm: torch.Tensor  # its gradient norm
    # The data position after the bad step's batches, as the per-step check leaves it: a
    # resumed run does not meet the batch that broke the update again.
    position: tuple[int, int]


@dataclass
class Settled:
    skipped: int = 0  # updates skipped since the last boundary (``skip``)
    trip: Trip | None = None  # ``stop``: the first bad update, if any
    verdicts: list[bool] = field(default_factory=list)  # ``skip``: each step's, True = skipped


class SkipStreak:
    """``train.nan_skip_limit``: a ``skip`` run whose updates are all skipped learns nothing,
    so after that many in a row it fails rather than "finish".

    Every verdict is of the all-reduced gradient norm, the same on every rank, so every rank
    counts the same streak and trips at the same step with no collective of its own.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0  # updates skipped in a row, up to the newest recorded
        self.first = 0  # the step of the streak's first skipped update

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.count = 0
            return
        if not self.count:
            self.first = step
        self.count += 1

    @property
    def tripped(self) -> bool:
        return 0 < self.limit <= self.count

    def message(self, step: int) -> str:
        return (
            f"the last {self.count} updates (steps {self.first}-{step}) were all skipped for a "
            f"non-finite gradient: the run is learning nothing "
            f"(train.nan_policy = 'skip', train.nan_skip_limit = {self.limit})"
        )


def deferrable(
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    device_type: str,
) -> bool:
    """``optimizer``: one, or a list of them (every one must be fused)."""
    mode = os.environ.get(ENV, "auto")
    every = optimizer if isinstance(optimizer, list) else [optimizer]
    fused = all(bool(o.defaults.get("fused")) for o in every) and scaler is None
    if mode == "each-step":
        return False
    if mode == "deferred":
        return fused
    return fused and device_type == "cuda"


class Guard:
    def __init__(
        self,
        policy: str,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        scaler: torch.amp.GradScaler | None,
        device: torch.device,
    ):
        # With an fp16 GradScaler, a non-finite gradient is an overflow the scaler handles.
        self.stop = policy == "stop" and scaler is None
        self.skip = policy == "skip"
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.optimizer = self.optimizers[0]
        self.deferred = (self.stop or self.skip) and deferrable(optimizer, scaler, device.type)
        self._latch = torch.zeros((), device=device)
        self._norms: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._positions: list[tuple[int, int]] = []

    def bad_now(
        self, grad_norm: torch.Tensor, last_loss: torch.Tensor, position: DataPosition
    ) -> bool:
        """Before the update: True when the host knows now that it must not be made.

        Deferred, always False: the update is gated on the device and judged at
        :meth:`settle`. ``position`` is the data position after this step's batches.
        """
        if not (self.stop or self.skip):
            return False
        if not self.deferred:
            if type(grad_norm) is torch.Tensor:  # a plain number to read: no kernel for it
                return not math.isfinite(grad_norm.item())
            return not bool(torch.isfinite(grad_norm))
        bad = torch.isfinite(grad_norm).logical_not().float()
        if self.stop:
            bad = self._latch = torch.maximum(self._latch, bad)
        for optimizer in self.optimizers:
            # read by the fused kernel, never by the host; torch's stubs do not declare it
            optimizer.found_inf = bad  # type: ignore[attr-defined]
        self._norms.append(grad_norm)
        self._losses.append(last_loss)
        self._positions.append((position.epoch, position.samples))
        return False

    def settle(self) -> Settled:
        """At a boundary (one host sync): what the updates since the last one did."""
        if not self._norms:
            return Settled()
        finite = torch.isfinite(torch.stack(self._norms)).tolist()
        out = Settled(skipped=finite.count(False) if self.skip else 0)
        if self.skip:
            out.verdicts = [not ok for ok in finite]
        if self.stop and False in finite:
            i = finite.index(False)
            out.trip = Trip(
                steps_back=len(finite) - i,
                loss=self._losses[i],
                norm=self._norms[i],
                position=self._positions[i],
            )
        self._norms, self._losses, self._positions = [], [], []
        return out


def rewind_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Put a LambdaLR (and its optimizer's lrs) back ``steps`` steps, as if never taken."""
    scheduler.last_epoch -= steps
    torch_private.rewind_step_count(scheduler, steps)
    lrs = [
        base * fn(scheduler.last_epoch)
        for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    torch_private.set_last_lr(scheduler, lrs)
