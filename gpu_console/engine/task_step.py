"""A task-owned step: ``train_step(model, batch, optimizers, ctx)`` runs its own updates.

A GAN updates its discriminator, then its generator, from two losses: one ``compute`` loss
cannot say that. With ``train_step`` the task calls, in its own order:

- ``optimizers.backward(loss, name)``: the gradients of ``loss`` for that optimizer's
  parameters only (``backward(inputs=...)``: a generator's loss leaves the discriminator's
  gradients alone), divided by ``train.grad_accum``, scaled by that optimizer's own
  GradScaler under fp16, outside autocast;
- ``optimizers.step(name)``: at the accumulation boundary (the last micro-batch of the
  step; before it, nothing) the engine averages that optimizer's gradients over the ranks
  (one all-reduce), unscales them (fp16), clips them to ``train.clip_grad_norm``, skips the
  update if their norm is not finite (``nan_policy`` skip or stop), steps, and sets them to
  ``None``;
- ``optimizers.step(name, closure=fn)``: an optimizer that evaluates the loss again
  (LBFGS): ``fn`` computes the loss, calls ``optimizers.backward(loss, name)`` and returns
  the loss; each evaluation is averaged over the ranks and clipped;
- ``optimizers[name]``: the optimizer itself (its lr, its groups).

The engine runs ``train_step`` under autocast, once per micro-batch, with the bare model
(not the DDP wrapper: averaging is the engine's, in ``step``; buffers such as BatchNorm's
running statistics stay each rank's own), and steps every per-step schedule after it, as
for ``compute``. ``train_step`` returns a :class:`TaskOutput` (its loss is what the step
events report).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .closure_step import mean_over_ranks, needs_closure
from .optim_set import Optimizers, OptimizerSetupError
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
    ):
        self._opts = {e.name: e for e in opts.entries}
        self.device, self.world_size, self.accum = device, world_size, accum
        self.max_norm, self.guard = max_norm, guard_non_finite
        self.scalers = scalers  # name → GradScaler (fp16 on CUDA), else None
        self.final = True  # whether this micro-batch ends the step (step() acts)
        self._norms: dict[str, torch.Tensor] = {}
        self.skipped = 0
        self.sharded = False  # FSDP: gradients arrive averaged, as shards (fsdp.py)

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
        with torch.autocast(self.device.type, enabled=False):
            if self.sharded:
                self._sharded_backward(loss, name)
            else:
                loss.backward(inputs=params)

    def _sharded_backward(self, loss: torch.Tensor, name: str) -> None:
        """FSDP: gradients reach the shards through its reduce-scatter after the gathered
        parameters' backward, which ``backward(inputs=shards)`` would never run. So a whole
        backward, and the other optimizers' gradients are put back as they were (the loop
        reduces every micro-batch for a task's own step, so none wait unreduced)."""
        others = [q for e in self._opts.values() if e.name != name for q in e.params]
        kept = [q.grad for q in others]
        for q in others:
            q.grad = None
        loss.backward()
        for q, g in zip(others, kept, strict=True):
            q.grad = g

    def step(self, name: str, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """At the step's last micro-batch: average, unscale, clip, check, step, zero.

        ``closure`` (an optimizer such as LBFGS whose ``step`` evaluates the loss again):
        it computes the loss, calls ``backward(loss, name)`` and returns the loss; each of
        its evaluations is averaged over the ranks and clipped (:meth:`_closure_step`)."""
        if not self.final:
            return
        entry = self._entry(name)
        if closure is not None:
            return self._closure_step(entry, closure)
        if needs_closure(entry.optimizer):
            raise TypeError(
                f"optimizers.step({name!r}): {type(entry.optimizer).__name__} steps with a "
                f"closure: optimizers.step({name!r}, closure=...) (docs/tasks.md)"
            )
        params = [q for q in entry.params if q.requires_grad]
        if not self.sharded:
            average(params, self.world_size)
        scaler = self.scalers[name] if self.scalers is not None else None
        if scaler is not None:
            scaler.unscale_(entry.optimizer)
        norm = self._clip(params, self.max_norm)
        self._norms[name] = norm
        if scaler is not None:  # an overflow is the scaler's to skip
            scaler.step(entry.optimizer)
            scaler.update()
        elif self.guard and not bool(torch.isfinite(norm)):
            self.skipped += 1
        else:
            entry.optimizer.step()
        entry.optimizer.zero_grad(set_to_none=True)

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
        if self.guard and not bool(torch.isfinite(norm)):
            self.skipped += 1
        else:  # the optimizer's first call gets the evaluation above back
            again = functools.partial(self._evaluate_again, [loss], entry, params, closure)
            entry.optimizer.step(again)
        entry.optimizer.zero_grad(set_to_none=True)

    def _evaluate(self, entry, params, closure) -> tuple[torch.Tensor, torch.Tensor]:
        """One evaluation: the task's closure from zeroed gradients, the gradients averaged
        over the ranks and clipped; the loss averaged over the ranks, and the norm."""
        entry.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():  # an optimizer's step runs under no_grad
            loss = closure()
        if not self.sharded:
            average(params, self.world_size)
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
        if self.sharded:
            from .fsdp import total_norm

            return total_norm(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def finish(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """After the step's last micro-batch: the norm over all, each one's, and skips."""
        norms, self._norms = self._norms, {}
        skipped, self.skipped = self.skipped, 0
        if not norms:
            return torch.zeros((), device=self.device), norms, skipped
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
        return total, norms, skipped


def average(params: list[torch.Tensor], world_size: int) -> None:
    """Every rank's gradients of ``params`` replaced by their mean (one flat all-reduce);
    a parameter this rank gave no gradient counts as zeros, so every rank sends the same
    shapes."""
    if world_size == 1 or not params:
        return
    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat.mul_(1.0 / world_size)  # as DDP: scaled as it is copied in, then summed
    dist.all_reduce(flat)
    offset = 0
    for q, g in zip(params, grads, strict=True):
        n = g.numel()
        q.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def step_optimizers(task, opts: Optimizers, train, d, scaler) -> StepOptimizers:
    """What the task's ``train_step`` is handed; one GradScaler per optimizer where the run
    has one (fp16 on CUDA)."""
    scalers = None
    if scaler is not None:
        # The run's kind of scaler (FSDP's sharded one agrees on an overflow over the ranks).
        scalers = {e.name: type(scaler)(d.device.type) for e in opts.entries}
    return StepOptimizers(
        opts,
        d.device,
        d.world_size,
        train.grad_accum,
        train.clip_grad_norm if train.clip_grad_norm > 0 else math.inf,
        train.nan_policy in ("skip", "stop"),
        scalers,
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
        # FSDP: gradients arrive reduced, as shards; DDP: the step averages them itself.
        self.step_optimizers.sharded = strategy.sharded_gradients

    def forward(self, batch, final: bool, step: int) -> Any:
        # A task's own step averages at its end (under FSDP: reduces every backward), so no
        # micro-batch runs without gradient sync.
        return self.step_optimizers.run(self.task, self.strategy.wrapped.module, batch, final,
                                        self.ctx, step)  # fmt: skip

    def update(self, last_loss, output, position, logging: bool) -> Update:
        grad_norm, grad_norms, skipped = self.step_optimizers.finish()
        return Update(last_loss, output, grad_norm, grad_norms, skipped)
