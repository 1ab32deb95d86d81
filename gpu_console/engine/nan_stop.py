"""``train.nan_policy`` ending a run: ``stop`` tripping (the last finite state checkpointed,
then the run fails), and ``skip`` skipping every update for ``nan_skip_limit`` steps.

Every rank reaches these together (the gradient norm is all-reduced, a log step's loss is
every rank's), saves together, and raises :class:`NonFiniteLoss`, which the run records as
failed, naming the step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import checkpoint, fsdp
from .data import DataPosition
from .nonfinite import NonFiniteLoss, SkipStreak, Trip, rewind_schedule

if TYPE_CHECKING:
    from ..profile import CheckpointConfig
    from .checkpointer import Checkpointer
    from .distributed import Dist
    from .optim_set import Optimizers
    from .reporter import Reporter
    from .train_state import TrainState


class NanStop:
    def __init__(
        self,
        out: Reporter,
        d: Dist,
        ckpt_cfg: CheckpointConfig,
        checkpointer: Checkpointer,
        model: torch.nn.Module,
        opts: Optimizers,
    ) -> None:
        self.out, self.d, self.cfg = out, d, ckpt_cfg
        self.checkpointer, self.model, self.opts = checkpointer, model, opts

    def stop(self, step: int, last_loss: torch.Tensor, grad_norm) -> None:
        """Before update ``step + 1``, whose gradient norm is not finite: save, then fail."""
        loss = last_loss.detach().clone().to(torch.float64)
        dist.all_reduce(loss)
        loss_v = loss.item() / self.d.world_size
        bad = step + 1  # the update that would have been made
        what = (
            f"loss is {loss_v}"
            if not math.isfinite(loss_v)
            else f"gradient norm is {float(grad_norm)} (loss {loss_v:.6g})"
        )
        where = f"{what} in step {bad} (train.nan_policy = 'stop')"
        save = self.checkpointer.save
        if self.cfg.on_stop and step > 0:
            self.out.status("stopping", reason="nan")
            saved = save("nan")
            kept = (
                f"; checkpoint {checkpoint.step_dir_name(step)} holds the last finite state"
                if saved
                else "; the checkpoint of the last finite state could not be written"
            )
        else:
            save(None)  # the write in flight ends first
            kept = "; no checkpoint written (checkpoint.on_stop = false)" if step else ""
        raise NonFiniteLoss(where + kept)

    def rewind(self, state: TrainState, trip: Trip) -> None:
        """A deferred check found the first bad update: back to the last finite step (its
        step count, schedule and the data after the bad batches), then :meth:`stop`."""
        state.step -= trip.steps_back
        for e in self.opts.entries:
            if e.scheduler is not None:
                rewind_schedule(e.scheduler, trip.steps_back)
        state.batches.position = DataPosition(*trip.position)
        self.stop(state.step, trip.loss, trip.norm)

    def fail(self, step: int, error: NonFiniteLoss) -> None:
        """A non-finite loss seen at a log step: keep the weights if they are still finite."""
        ok = all(bool(torch.isfinite(fsdp.local(q)).all()) for q in self.model.parameters())
        finite = torch.tensor([float(ok)], device=self.d.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if self.cfg.on_stop and finite.item() == 1.0:
            self.out.status("stopping", reason="nan")
            if self.checkpointer.save("nan"):
                raise NonFiniteLoss(
                    f"{error}; checkpoint {checkpoint.step_dir_name(step)} holds the weights, "
                    "which are still finite"
                ) from None
        self.checkpointer.save(None)  # the write in flight ends first
        raise error

    def check_streak(self, step: int, streak: SkipStreak) -> None:
        """``nan_skip_limit``: a run whose updates are all skipped learns nothing: it fails
        (every rank counts the same streak, the verdicts being of all-reduced norms)."""
        if streak.tripped:
            self.checkpointer.save(None)  # the write in flight ends first
            raise NonFiniteLoss(streak.message(step))
