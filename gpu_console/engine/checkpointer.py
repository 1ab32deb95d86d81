"""The run's checkpoints: saving one (its state, through the strategy), settling a write's
outcome on every rank, the newest and the best.

A save is collective. The write in flight is waited for first (one at a time); interval
and best checkpoints return once the state is copied (``checkpoint.async_write``) and their
outcome is settled at a later step boundary. A write that fails (a full disk) leaves the
previous checkpoint complete and named in LATEST; an error event says so and the run goes
on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import checkpoint
from .best import resumed as best_so_far
from .checkpoint_writer import Writer
from .strategy import SaveJob

if TYPE_CHECKING:
    from torch import nn

    from ..profile import Profile
    from .distributed import Dist
    from .heartbeat import Beat
    from .hooks import Hooks
    from .optim_set import Optimizers
    from .reporter import Reporter
    from .strategy import Scalers, Strategy
    from .train_state import TrainState


@dataclass
class Saved:
    """What a checkpoint holds besides the strategy's own way of writing it."""

    model: nn.Module
    opts: Optimizers  # every optimizer and schedule, by name
    scalers: Scalers  # one GradScaler, one per optimizer, or None
    hooks: Hooks  # the task's state


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        p: Profile,
        d: Dist,
        out: Reporter,
        beat: Beat,
        strategy: Strategy,
        saved: Saved,
        state: TrainState,
        resume: Path | None,
    ) -> None:
        self.run_dir, self.cfg, self.d, self.out, self.beat = run_dir, p.checkpoint, d, out, beat
        self.strategy, self.saved, self.state = strategy, saved, state
        dp = p.distributed  # never shorter than either timeout of the default group
        self.group = checkpoint.write_group(max(dp.collective_timeout_s, dp.startup_timeout_s))
        # checkpoint.async_write: training waits for a copy of the state, a thread writes it.
        self.writer = Writer(run_dir, d.device, d.is_main, self.group, self.cfg.keep_last,
                             self.cfg.async_write)  # fmt: skip
        self.newest = checkpoint.Newest()
        self.best = best_so_far(self.cfg.keep_best, self.cfg.best_direction(), resume, run_dir)
        self.early_wait = 0.0  # seconds settle_before_log waited, for the next save's figures
        self.failure = ""  # the last write that failed, in one line
        self.kept: str | None = None  # and the checkpoint LATEST still named then

    def save(self, reason: str | None, wait: bool = True) -> bool:
        """Collective. False when rank 0 could not write it (the previous one stays).

        ``wait=False``: return once the state is copied, the outcome is settled at a later
        step boundary. ``reason=None``: only wait for the write in flight.
        """
        step = self.state.step
        early, self.early_wait = self.early_wait, 0.0  # waited already, before this step's log
        requested = time.perf_counter() - early
        self.beat.set(step, "checkpoint")
        self.settle(self.writer.wait())
        waited = time.perf_counter() - requested
        if reason is None:
            return True
        outcome = self.strategy.save(self._job(step, reason, requested, waited))
        if outcome is None and not wait:
            return True
        return self.settle(outcome or self.writer.wait())

    def settle_before_log(self) -> None:
        """Collective, at a step that saves or ends, before its log: the write in flight is
        waited for now, not at the save, so its event comes before this step's. The wait is
        the save's: counted in its ``waited_s`` and ``blocked_s``."""
        begun = time.perf_counter()
        self.beat.set(self.state.step, "checkpoint")
        self.settle(self.writer.wait())
        self.early_wait += time.perf_counter() - begun

    def _job(self, step: int, reason: str, requested: float, waited: float) -> SaveJob:
        s, d = self.saved, self.d
        state = {
            "model": s.model.state_dict(),
            **s.opts.state_dict(),  # every optimizer and schedule, by name
            "scaler": checkpoint.scaler_state(s.scalers),  # one, or one per optimizer
            "step": step,
            "data": self.state.batches.position.state_dict(),
            "world_size": d.world_size,
            "evaluated_at": self.state.evaluated_at,
            "early_stop": self.state.early_stop,
        }
        rank_state = {"rng": checkpoint.capture_rng(d.device), **s.hooks.state()}
        return SaveJob(
            self.run_dir, step, reason, state, rank_state, self.best.for_save(step), requested,
            waited, s.model, s.opts, self.writer, self.group, self.cfg.keep_last, d.is_main,
        )  # fmt: skip

    def settle(self, outcome: dict[str, Any] | None) -> bool:
        """A write's outcome, the same on every rank: its event, or its failure reported."""
        if outcome is None:
            return True
        if outcome["ok"]:
            self.newest.event = outcome["event"]
            if self.d.is_main:
                self.out.event("checkpoint", **outcome["event"])
            return True
        # Every node's first rank says so: each node's status records the stop as unsaved.
        message, failed = checkpoint.failure(outcome["step"], outcome["reason"], outcome)
        self.out.log("error", message, checkpoint_failed=failed)
        self.failure = message
        self.kept = failed["latest"]  # rank 0's LATEST, the same answer on every rank
        return False

    def settle_finished(self) -> None:
        """A background write that ended: its event, or its failure."""
        self.settle(self.writer.finished())

    def requested(self, step: int) -> dict[str, Any]:
        """The console's checkpoint command: this step's checkpoint, written unless it is."""
        self.save(None)  # a write in flight of this step answers the request once complete
        if self.newest.at(step) is None:  # else this step's checkpoint answers the request
            self.save("request")
        return {"checkpoint": self.newest.at(step)} if self.newest.at(step) is not None else {}
