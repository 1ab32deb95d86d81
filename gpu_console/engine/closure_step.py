"""The update step of an optimizer whose ``step`` needs a closure (LBFGS), through the engine.

LBFGS evaluates the loss and the gradient several times in one step (its inner iterations,
its line search). Each evaluation here runs every micro-batch of the step again (the same
batches), backward through the strategy (DDP averages the gradients over the ranks in each
one), clips, and returns the loss averaged over the ranks: every rank's LBFGS sees the same
numbers and makes the same decisions, so the ranks make the same collectives, and 2 ranks
give what 1 rank gives with the global batch. The first evaluation is made before the step:
its gradient norm is the non-finite check's (skip or stop), its micro-batches fill the log
row, and the optimizer's own first call gets it back without a second forward.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .data import move
from .optim_set import OptimizerSetupError
from .update_step import EngineStep, Update

if TYPE_CHECKING:
    from .data import Batches
    from .optim_set import Optimizers
    from .step_log import StepLogger
    from .strategy import Scalers, Strategy


def mean_over_ranks(loss: torch.Tensor, world_size: int) -> torch.Tensor:
    """The loss averaged over the ranks: what every rank's closure optimizer decides on."""
    mean = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(mean)
        mean /= world_size
    return mean


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step`` takes a closure it cannot do without (LBFGS's)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check(opts: Optimizers, scaler: Scalers) -> None:
    """A closure optimizer is the run's only one, and without fp16's loss scaling."""
    names = [e.name for e in opts.entries if needs_closure(e.optimizer)]
    if not names:
        return
    where = f"task.configure_optimizers: optimizer {names[0]!r}"
    if len(opts.entries) > 1:
        raise OptimizerSetupError(
            f"{where}: an optimizer that steps with a closure ({type(opts.first).__name__}) "
            "must be the task's only one (its closure evaluates the whole model)"
        )
    if scaler is not None:
        raise OptimizerSetupError(
            f"{where}: a closure optimizer cannot step under fp16's loss scaling; use "
            "train.precision = bf16, fp32 or fp64"
        )


class ClosureStep(EngineStep):
    owner = "engine (closure)"

    def bind(self, strategy: Strategy, autocast: contextlib.AbstractContextManager) -> None:
        super().bind(strategy, autocast)
        self.guard.deferred = False  # LBFGS reads the loss on the host at every evaluation

    def run(self, step: int, batches: Batches, logger: StepLogger, logging: bool) -> Update:
        self.beat.set(step + 1, "data")
        micro = [move(batches.next(), self.d.device) for _ in range(self.accum)]
        self.beat.set(step + 1, "compute")
        last_loss, output = self._evaluate(micro, step, logger, logging)
        first = [self._mean(last_loss)]

        def closure() -> torch.Tensor:
            if first:  # the evaluation made above: its gradients are in place
                return first.pop()
            self.opts.zero_grad()
            loss, _ = self._evaluate(micro, step, None, False)
            return self._mean(loss)

        self.beat.set(step + 1, "update")
        done = Update(last_loss, output, self.grad_norm, self.grad_norms)
        bad = self.guard.bad_now(self.grad_norm, last_loss, batches.position)
        if self.guard.stop and bad:
            self.opts.zero_grad()
            done.stop = True
        elif self.guard.skip and bad:
            done.skipped = 1
        else:
            with self.opts.watch.engine(self.opts.first):
                # torch's stubs want a closure of a float; its optimizers take the loss tensor
                self.opts.first.step(closure)  # type: ignore[arg-type]
        self.record(step + 1, done)
        if not done.stop:
            self.opts.schedule()
            self.opts.zero_grad()
        return done

    def _evaluate(
        self, micro: list[Any], step: int, logger: StepLogger | None, logging: bool
    ) -> tuple[torch.Tensor, Any]:
        """Every micro-batch's forward and backward, then the clip: this rank's loss and last
        output. ``logger``: the first evaluation's, counted in the step's window (its log row
        filled on a log step); the optimizer's further evaluations are not counted."""
        total = output = None
        for i, batch in enumerate(micro):
            final = i == len(micro) - 1
            with self.sync(final):
                with self.autocast:
                    output = self.forward(batch, final, step)
                loss = output.loss if self.accum == 1 else output.loss / self.accum
                total = loss.detach() if total is None else total + loss.detach()
                if logger is not None:
                    logger.micro_batch(output, total, final and logging, step)
                loss.backward()
        self.grad_norm, self.grad_norms = self.strategy.clip(self.opts, self.max_norm)
        assert total is not None  # a step has at least one micro-batch
        return total, output

    def _mean(self, loss: torch.Tensor) -> torch.Tensor:
        return mean_over_ranks(loss, self.d.world_size)
