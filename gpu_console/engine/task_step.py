"""A task-owned step: ``train_step(model, batch, optimizers, ctx)`` runs its own updates.

A GAN updates its discriminator, then its generator, from two losses: one ``compute`` loss
cannot say that. With ``train_step`` the task calls, in its own order:

- ``optimizers.backward(loss, name)``: the gradients of ``loss`` for that optimizer's
  parameters only (``backward(inputs=...)``: a generator's loss leaves the discriminator's
  gradients alone), divided by ``train.grad_accum``, scaled by that optimizer's own
  GradScaler under fp16, outside autocast;
- ``optimizers.step(name)``: at the accumulation boundary (the last micro-batch of the
  step; before it, nothing) the engine averages that optimizer's gradients over the ranks
  by the strategy's rule (``Strategy.average_grads``: DDP's buckets; the expert strategy's
  experts left to their own rule; FSDP's arrive reduced), unscales them (fp16), clips them
  to ``train.clip_grad_norm`` (``Strategy.clip_grads``), checks their norm (``nan_policy``:
  ``skip`` skips the update; ``stop`` makes no further update and stops the run before
  the step ends, as the engine's own step does), steps, and sets them to ``None``;
- ``optimizers.step(name, closure=fn)``: an optimizer that evaluates the loss again
  (LBFGS): ``fn`` computes the loss, calls ``optimizers.backward(loss, name)`` and returns
  the loss; each evaluation is averaged over the ranks and clipped;
- ``optimizers[name]``: the optimizer itself (its lr, its groups).

The engine runs ``train_step`` under autocast, once per micro-batch, with the bare model
(not the DDP wrapper: averaging is the engine's, in ``step``; buffers such as BatchNorm's
running statistics stay each rank's own), and steps every per-step schedule after it, as
for ``compute``. ``train_step`` returns a :class:`TaskOutput` (its loss is what the step
events report). On several ranks an optimizer that the task steps itself (``step()``, not
``optimizers.step``) is refused before it changes anything (step_watch.py): its gradients
would be this rank's alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .closure_step import mean_over_ranks, needs_closure
from .optim_set import Optimizers, OptimizerSetupError
from .strategy import TaskStepRules
from .update_step import Update, UpdateStep


class StepOptimizers(Mapping):
    """What ``train_step`` gets: the optimizers by name, and the engine's part of each update."""

    def __init__(
        self,
        opts: Optimizers,
        device: torch.device,
        world_size: int,
        accum: int,
        max_norm: float,
        guard_non_finite: bool,
        scalers: dict[str, Any] | None,
        stop_non_finite: bool = False,
    ):
        self._opts = {e.name: e for e in opts.entries}
        self.watch = opts.watch  # the engine's steps, told from a task's own (step_watch.py)
        self.device, self.world_size, self.accum = device, world_size, accum
        self.max_norm, self.guard = max_norm, guard_non_finite
        self.stop = guard_non_finite and stop_non_finite  # nan_policy = "stop"
        self.scalers = scalers  # name → GradScaler (fp16 on CUDA), else None
        self.final = True  # whether this micro-batch ends the step (step() acts)
        self._norms: dict[str, torch.Tensor] = {}
        self.skipped = 0
        self.stopped = False  # stop: a non-finite norm this step; no update after it
        # How gradients are reduced and clipped (TaskStep.bind); until then one rank's.
        self.strategy: TaskStepRules = TaskStepRules()

    # -- the mapping: name → optimizer ----------------------------------------------------
    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self._entry(name).optimizer

    def __iter__(self) -> Iterator[str]:
        return iter(self._opts)

    def __len__(self) -> int:
        return len(self._opts)

    def _entry(self, name: str):
        if name not in self._opts:
            raise KeyError(f"no optimizer {name!r} (the task's are {', '.join(self._opts)})")
        return self._opts[name]

    def run(self, task, model, batch, final: bool, ctx, step: int):
        """One micro-batch of the task's own step (``step``: the steps completed)."""
        self.final = final
        ctx.step = step
        return task.train_step(model, batch, self, ctx)

    # -- the engine's part -----------------------------------------------------------------
    def backward(self, loss: torch.Tensor, name: str) -> None:
        """Gradients of ``loss`` for optimizer ``name``'s parameters (accumulated)."""
        params = [q for q in self._entry(name).params if q.requires_grad]
        if self.accum > 1:
            loss = loss / self.accum
        if self.scalers is not None:
            loss = self.scalers[name].scale(loss)
        others = [q for e in self._opts.values() if e.name != name for q in e.params]
        with torch.autocast(self.device.type, enabled=False):
            self.strategy.task_backward(loss, params, others)

    def step(self, name: str, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """At the step's last micro-batch: average, unscale, clip, check, step, zero.

        ``closure`` (an optimizer such as LBFGS whose ``step`` evaluates the loss again):
        it computes the loss, calls ``backward(loss, name)`` and returns the loss; each of
        its evaluations is averaged over the ranks and clipped (:meth:`_closure_step`)."""
        if not self.final:
            return
        entry = self._entry(name)
        if self.stopped:  # nan_policy = "stop" tripped earlier in this step: no more updates
            entry.optimizer.zero_grad(set_to_none=True)
            return
        if closure is not None:
            return self._closure_step(entry, closure)
        if needs_closure(entry.optimizer):
            raise TypeError(
                f"optimizers.step({name!r}): {type(entry.optimizer).__name__} steps with a "
                f"closure: optimizers.step({name!r}, closure=...) (docs/tasks.md)"
            )
        params = [q for q in entry.params if q.requires_grad]
        self.strategy.average_grads(params)
        scaler = self.scalers[name] if self.scalers is not None else None
        if scaler is not None:
            scaler.unscale_(entry.optimizer)
        norm = self._clip(params, self.max_norm)
        self._norms[name] = norm
        if scaler is not None:  # an overflow is the scaler's to skip
            with self.watch.engine(entry.optimizer):
                scaler.step(entry.optimizer)
            scaler.update()
        elif not self._bad(norm):
            with self.watch.engine(entry.optimizer):
                entry.optimizer.step()
        entry.optimizer.zero_grad(set_to_none=True)

    def _bad(self, norm: torch.Tensor) -> bool:
        """Whether ``nan_policy`` keeps this update from being made: a non-finite norm
        (of the averaged gradients: every rank decides alike) is skipped, or stops the run."""
        if not self.guard or bool(torch.isfinite(norm)):
            return False
        if self.stop:
            self.stopped = True
        else:
            self.skipped += 1
        return True

    def _closure_step(self, entry, closure: Callable[[], torch.Tensor]) -> None:
        """Every evaluation, the first included, is the task's closure from zeroed gradients,
        then the average over the ranks, the clip and the loss's mean over the ranks: every
        rank's optimizer sees the same numbers and makes the same decisions (the same
        collectives), so 2 ranks step as 1 rank with the global batch. The first evaluation
        is made here, before the step: its norm is the non-finite check's, and the
        optimizer's own first call gets it back without a second forward."""
        name = entry.name
        if self.accum > 1:  # the earlier micro-batches' gradients would be zeroed unseen
            raise ValueError(
                f"optimizers.step({name!r}, closure=...): needs train.grad_accum = 1 (a "
                f"closure evaluates its own batch; got {self.accum})"
            )
        if self.scalers is not None:
            raise ValueError(
                f"optimizers.step({name!r}, closure=...): a closure cannot step under fp16's "
                "loss scaling; use train.precision = bf16, fp32 or fp64"
            )
        params = [q for q in entry.params if q.requires_grad]
        loss, norm = self._evaluate(entry, params, closure)
        self._norms[name] = norm
        if not self._bad(norm):  # the optimizer's first call gets the evaluation above back
            again = functools.partial(self._evaluate_again, [loss], entry, params, closure)
            with self.watch.engine(entry.optimizer):
                entry.optimizer.step(again)
        entry.optimizer.zero_grad(set_to_none=True)

    def _evaluate(self, entry, params, closure) -> tuple[torch.Tensor, torch.Tensor]:
        """One evaluation: the task's closure from zeroed gradients, the gradients averaged
        over the ranks and clipped; the loss averaged over the ranks, and the norm."""
        entry.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():  # an optimizer's step runs under no_grad
            loss = closure()
        self.strategy.average_grads(params)
        norm = self._clip(params, self.max_norm)
        return mean_over_ranks(loss, self.world_size), norm

    def _evaluate_again(self, first: list, entry, params, closure) -> torch.Tensor:
        """The closure the optimizer calls: the evaluation made before the step, then new
        ones."""
        return first.pop() if first else self._evaluate(entry, params, closure)[0]

    def clip(self, name: str, max_norm: float) -> torch.Tensor:
        """Clip optimizer ``name``'s gradients to ``max_norm`` now (after :meth:`step`
        averaged them the engine clips to ``train.clip_grad_norm`` anyway)."""
        return self._clip(self._entry(name).params, max_norm)

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.strategy.clip_grads(params, max_norm)

    def finish(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """After the step's last micro-batch (read :attr:`stopped` before): the norm over
        all, each one's, and skips."""
        norms, self._norms = self._norms, {}
        skipped, self.skipped = self.skipped, 0
        self.stopped = False
        if not norms:
            return torch.zeros((), device=self.device), norms, skipped
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
        return total, norms, skipped


def step_optimizers(task, opts: Optimizers, train, d, scaler) -> StepOptimizers:
    """What the task's ``train_step`` is handed; one GradScaler per optimizer where the run
    has one (fp16 on CUDA)."""
    scalers = None
    if scaler is not None:
        # The run's kind of scaler (FSDP's sharded one agrees on an overflow over the ranks).
        scalers = {
            e.name: type(scaler)(d.device.type, init_scale=train.loss_scale_init)
            for e in opts.entries
        }
    return StepOptimizers(
        opts,
        d.device,
        d.world_size,
        train.grad_accum,
        train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf,
        train.nan_policy in ("skip", "stop"),
        scalers,
        stop_non_finite=train.nan_policy == "stop",
    )


class TaskStep(UpdateStep):
    """The update step of a task with ``train_step``: its backward and updates happen in it
    (through :class:`StepOptimizers`), with the bare model; the engine then schedules."""

    owner = "task"

    def __init__(self, task, opts, train, d, scaler, ctx, beat) -> None:
        closures = [e.name for e in opts.entries if needs_closure(e.optimizer)]
        if closures:  # what its step (optimizers.step with a closure) needs, checked now
            where = f"task.configure_optimizers: optimizer {closures[0]!r} steps with a closure"
            if train.grad_accum > 1:
                raise OptimizerSetupError(
                    f"{where}: needs train.grad_accum = 1 (got {train.grad_accum})"
                )
            if scaler is not None:
                raise OptimizerSetupError(
                    f"{where}: not under fp16's loss scaling; use train.precision = bf16, "
                    "fp32 or fp64"
                )
        self.step_optimizers = step_optimizers(task, opts, train, d, scaler)
        super().__init__(task, opts, train, d, self.step_optimizers.scalers, ctx, beat)

    def bind(self, strategy, autocast) -> None:
        super().bind(strategy, autocast)
        self.step_optimizers.strategy = strategy  # its averaging, clipping, backward

    def forward(self, batch, final: bool, step: int) -> Any:
        # A task's own step averages at its end (under FSDP: reduces every backward), so no
        # micro-batch runs without gradient sync.
        return self.step_optimizers.run(self.task, self.strategy.wrapped.module, batch, final,
                                        self.ctx, step)  # fmt: skip

    def update(self, last_loss, output, position, logging: bool) -> Update:
        stop = self.step_optimizers.stopped  # nan_policy = "stop" tripped in this step
        grad_norm, grad_norms, skipped = self.step_optimizers.finish()
        return Update(last_loss, output, grad_norm, grad_norms, skipped, stop)
