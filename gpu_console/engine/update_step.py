"""The update step, as one interface: a step's micro-batches, then its update.

Three implementations: :class:`EngineStep`, the engine's own (``compute`` per micro-batch,
backward, then unscale, clip, the non-finite check, step, schedule); its closure form for an
optimizer that steps with one (LBFGS: closure_step.py); and
``task_step.TaskStep``, a task's ``train_step`` that makes its updates itself through the
engine's ``StepOptimizers``. The trainer calls :meth:`UpdateStep.run` once per step and
never asks which one it has.

A micro-batch that is not the step's last runs with the strategy's gradient sync off
(``no_sync``) where the step lets the strategy reduce; a log step's row is filled after the
last micro-batch's forward and before its backward, so it rides the gradient reduction.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .data import move
from .nonfinite import Guard, Settled, SkipStreak

if TYPE_CHECKING:
    from ..profile import TrainConfig
    from ..tasks.base import Task
    from .context import TaskContext
    from .data import Batches, DataPosition
    from .distributed import Dist
    from .heartbeat import Beat
    from .optim_set import Optimizers
    from .step_log import StepLogger
    from .strategy import Scalers, Strategy
    from .task_step import StepOptimizers


@dataclass
class Update:
    """What one step did."""

    last_loss: torch.Tensor  # this rank's loss of the step (its micro-batches' sum)
    output: Any  # the last micro-batch's TaskOutput (the task's step_end hook gets it)
    grad_norm: torch.Tensor
    grad_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy = "skip")
    stop: bool = False  # nan_policy = "stop" and the gradient is not finite: not made


class Updater(Protocol):
    """What the build and the trainer call on an update step, whichever one it is."""

    owner: str
    step_optimizers: StepOptimizers | None
    scalers: Scalers
    streak: SkipStreak

    def bind(self, strategy: Strategy, autocast: contextlib.AbstractContextManager) -> None:
        """After the strategy wrapped the model: what the micro-batches run with."""

    def run(self, step: int, batches: Batches, logger: StepLogger, logging: bool) -> Update:
        """Step ``step + 1``: every micro-batch, then the update (``logging``: a log step)."""
        ...

    def settle(self, boundary: bool, step: int) -> Settled:
        """At a boundary (``step``): what the updates gated on the device did."""
        ...


class UpdateStep:
    """The implementations' common part (an :class:`Updater`)."""

    owner = ""  # who runs backward and step: the start event's ``train_step``
    step_optimizers: Any = None  # a task's own step: what its train_step is handed

    def __init__(
        self,
        task: Task,
        opts: Optimizers,
        train: TrainConfig,
        d: Dist,
        scalers: Scalers,
        ctx: TaskContext,
        beat: Beat,
    ) -> None:
        self.task, self.opts, self.d, self.ctx, self.beat = task, opts, d, ctx, beat
        self.accum = train.grad_accum
        self.max_norm = train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf
        self.nan_policy = train.nan_policy
        # train.nan_skip_limit: skipped updates in a row, judged at log steps (the trainer).
        self.streak = SkipStreak(train.nan_skip_limit if train.nan_policy == "skip" else 0)
        self.scalers = scalers  # what a checkpoint saves: one scaler, one per optimizer, None
        self.strategy: Any = None
        self.autocast: Any = contextlib.nullcontext()

    def bind(self, strategy: Strategy, autocast: contextlib.AbstractContextManager) -> None:
        """After the strategy wrapped the model: what the micro-batches run with."""
        self.strategy, self.autocast = strategy, autocast

    def run(self, step: int, batches: Batches, logger: StepLogger, logging: bool) -> Update:
        """Step ``step + 1``: every micro-batch, then the update (``logging``: a log step)."""
        last_loss = output = None
        for micro in range(self.accum):
            self.beat.set(step + 1, "data")  # the step in progress
            batch = move(batches.next(), self.d.device)
            self.beat.set(step + 1, "compute")
            final = micro == self.accum - 1
            with self.sync(final):
                with self.autocast:
                    output = self.forward(batch, final, step)
                loss = output.loss if self.accum == 1 else output.loss / self.accum
                part = loss.detach()
                last_loss = part if last_loss is None else last_loss + part
                logger.micro_batch(output, last_loss, final and logging, step)
                self.backward(loss)
        assert last_loss is not None  # train.grad_accum >= 1: a micro-batch ran
        self.beat.set(step + 1, "update")
        update = self.update(last_loss, output, batches.position, logging)
        self.record(step + 1, update)
        if not update.stop:
            self.opts.schedule()
            self.opts.zero_grad()
        return update

    def settle(self, boundary: bool, step: int) -> Settled:
        """At a boundary (``step``): what the updates gated on the device did (nonfinite.py)."""
        return Settled()

    # -- what an implementation says -----------------------------------------------------
    def record(self, step: int, update: Update) -> None:
        """Step ``step``'s verdict into the skip streak, where it is known now."""
        self.streak.record(step, update.skipped > 0)

    def sync(self, final: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward(self, batch: Any, final: bool, step: int) -> Any:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """After the forward (and after a log step's row is filled)."""

    def update(
        self, last_loss: torch.Tensor, output: Any, position: DataPosition, logging: bool
    ) -> Update:
        raise NotImplementedError


class EngineStep(UpdateStep):
    """The engine's step: ``compute``, backward, unscale, clip, the non-finite check, step."""

    owner = "engine"

    def bind(self, strategy: Strategy, autocast: contextlib.AbstractContextManager) -> None:
        super().bind(strategy, autocast)
        assert not isinstance(self.scalers, dict)  # by name: a task's own step's alone
        self.scaler = self.scalers
        self.guard = Guard(
            self.nan_policy, [e.optimizer for e in self.opts.entries], self.scaler, self.d.device
        )
        if not self.opts.rewindable():  # a torch scheduler cannot step back
            self.guard.deferred = False
        self.grad_norm = torch.zeros((), device=self.d.device)  # the last one computed
        self.grad_norms: dict[str, torch.Tensor] = {}

    def sync(self, final: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if final else self.strategy.no_sync()

    def forward(self, batch: Any, final: bool, step: int) -> Any:
        return self.task.compute(self.strategy.compute_model, batch)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def update(
        self, last_loss: torch.Tensor, output: Any, position: DataPosition, logging: bool
    ) -> Update:
        guard, scaler = self.guard, self.scaler
        if scaler is not None:
            self.opts.unscale(scaler)
        if self.max_norm < math.inf or logging or guard.skip or guard.stop:
            self.grad_norm, self.grad_norms = self.strategy.clip(self.opts, self.max_norm)
        done = Update(last_loss, output, self.grad_norm, self.grad_norms)
        # The norm is of the all-reduced gradients, the same on every rank, so every rank
        # skips (or stops before) the same update with no collective of its own. On GPUs
        # the verdict gates the update on the device, read at the next boundary.
        bad = guard.bad_now(self.grad_norm, last_loss, position)
        if guard.stop and bad:
            self.opts.zero_grad()
            done.stop = True
        elif guard.skip and bad:
            done.skipped = 1
            if scaler is not None:
                scaler.update()  # the scaler still learns from the overflow
        else:
            self.opts.step(scaler)
        return done

    def record(self, step: int, update: Update) -> None:
        if self.guard.skip and not self.guard.deferred:  # deferred: known at settle()
            self.streak.record(step, update.skipped > 0)

    def settle(self, boundary: bool, step: int) -> Settled:
        if not (self.guard.deferred and boundary):
            return Settled()
        settled = self.guard.settle()
        for i, skipped in enumerate(settled.verdicts):
            self.streak.record(step - len(settled.verdicts) + 1 + i, skipped)
        return settled


def for_task(
    task: Task,
    opts: Optimizers,
    train: TrainConfig,
    d: Dist,
    scaler: Scalers,
    ctx: TaskContext,
    beat: Beat,
) -> Updater:
    """The task's own step when it has ``train_step`` (task_step.py); else the engine's, or
    its closure form for an optimizer that steps with one (LBFGS, closure_step.py)."""
    own = getattr(task, "train_step", None) is not None
    # On several ranks, an optimizer the task steps itself is refused (step_watch.py).
    opts.watch.install(opts.entries, d.world_size, "task.train_step" if own else "task.compute")
    if own:
        from .task_step import TaskStep

        return TaskStep(task, opts, train, d, scaler, ctx, beat)
    from . import closure_step

    closure_step.check(opts, scaler)
    if closure_step.needs_closure(opts.first):
        return closure_step.ClosureStep(task, opts, train, d, scaler, ctx, beat)
    return EngineStep(task, opts, train, d, scaler, ctx, beat)
