"""What the run does with the console's commands and the scheduler's signals, once every rank
agreed on them (control.py): acknowledgements, pause and resume, a checkpoint on request, a
profile capture, a stop.

Between log steps (when they are further apart than the control interval) a control check
is a small collective of its own, at a step rank 0's clock chose; at a log step the
proposals ride with the step's exchange.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from .control import GIVE_UP
from .exchange import Row

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .control import Control, Decision
    from .distributed import Dist
    from .exchange import Exchange
    from .heartbeat import Beat
    from .reporter import Reporter
    from .step_log import StepLogger
    from .torch_profiler import Profiler
    from .train_state import TrainState

CONTROL_INTERVAL_S = 0.25


class DiskFullStop(RuntimeError):
    """The run ends because its events cannot be written (a full disk, for long)."""


class ControlHandler:
    def __init__(
        self,
        out: Reporter,
        d: Dist,
        beat: Beat,
        control: Control,
        exchange: Exchange,
        profiler: Profiler,
        checkpointer: Checkpointer,
        logger: StepLogger,
    ) -> None:
        self.out, self.d, self.beat, self.control = out, d, beat, control
        self.exchange, self.profiler = exchange, profiler
        self.checkpointer, self.logger = checkpointer, logger

    def paused(self, step: int) -> list[Row]:
        """A paused run's turn: no step, only the ranks' proposals."""
        self.beat.set(step, "paused")
        if self.d.local_rank == 0:
            time.sleep(CONTROL_INTERVAL_S)  # the other ranks wait in the exchange
        return self.exchange.control_only(self.control.proposal(step))

    def check(self, step: int) -> list[Row] | None:
        """A control check of its own, when one is due at ``step``."""
        if not self.control.due(step):
            return None
        self.beat.set(step, "control")
        return self.exchange.control_only(self.control.proposal(step))

    def obey(self, state: TrainState, rows: list[Row]) -> str | None:
        """The ranks' proposals decided and acted on; a stop's reason, else None."""
        step = state.step
        decision = self.control.decide(
            step, [(r.cmd, r.signalled, r.next_check, r.cmd_arg) for r in rows]
        )
        while self.control.warnings:
            self.out.log("warning", self.control.warnings.pop(0))
        if decision.signalled:
            self.out.log("warning", f"signal received: stopping at step {step}")
            self.profiler.finish(step, "signal")
            return "signal"
        if decision.cmd is None:
            return None
        if decision.cmd == GIVE_UP:  # every rank, at this step
            self.checkpointer.save(None)  # a write in flight ends first (unreported: no room)
            raise DiskFullStop(decision.why or "a node's events.jsonl cannot be written")
        self.ack(decision, "received", step)
        if decision.cmd == "profile":  # acknowledged when the traces are written
            ack = functools.partial(self.ack, decision)
            self.profiler.request(step, decision.arg, state.paused, ack)
            return None
        if decision.cmd == "stop":
            self.control.stopping()
            self.profiler.finish(step, "stop")
            self.ack(decision, "done", step)
            return "stop"
        done = {}
        if decision.cmd == "checkpoint":
            done = self.checkpointer.requested(step)
        elif decision.cmd == "pause":
            self.pause(state)
        elif decision.cmd == "resume":
            self.resume(state)
        self.ack(decision, "done", step, **done)
        return None

    def pause(self, state: TrainState) -> None:
        if not state.paused:
            self.profiler.finish(state.step, "pause")  # a paused run makes no steps to trace
            state.paused = True
            self.out.status("paused", reason="requested")

    def resume(self, state: TrainState) -> None:
        if state.paused:
            state.paused = False
            self.logger.new_window(keep_skipped=True)  # paused time is no step's
            self.out.status("running", reason="resumed")

    def ack(self, decision: Decision, state: str, step: int, **fields: object) -> None:
        """Acknowledge a command on the node whose control file held it (cmd_id is None
        elsewhere)."""
        if decision.cmd_id is not None:
            self.out.event("control", id=decision.cmd_id, cmd=decision.cmd, state=state,
                           step=step, **fields)  # fmt: skip
