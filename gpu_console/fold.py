"""THE fold of a run's events into its state: every reader of a run uses this one.

The supervisor writes ``status.json`` from it (so ``ls`` reads it), the headless console's
:class:`~gpu_console.state.RunState` and the run screen's model extend it with what only they
show. One rule each, so that they never disagree on the same events:

- step: the newest step event's, else the true step a ``checkpoint`` or ``status`` event
  carries (log steps may be far apart), else a ``start``'s ``start_step``;
- best loss: the lowest finite loss over every session of the run (a NaN is never best);
- best checkpoint: the newest checkpoint event marked ``best`` (``checkpoint.keep_best``);
- stall: no step for max(30 s, 10 × the median step time of the current torchrun group),
  where an eval batch (a ``progress`` event of the eval in progress) counts as a step; or,
  in any phase from the first heartbeat on, a live rank whose heartbeat thread has been
  silent for 30 s (the thread writes every second whatever the rank does: see
  :func:`.heartbeats.frozen_ranks`);
- means (MFU, samples/s): over the current session (a resume may run on other hardware);
  a torchrun restart within a session continues its session;
- restarts: the newest ``start``'s count (torchrun's, within the session);
- train metrics: each task metric's newest value (a step event without it keeps the last);
- skipped updates (``nan_policy = "skip"``): the sum of the step events' ``skipped`` over
  every session (None when no step event carries it: another policy).

Imports no torch and nothing heavy: the supervisor folds with it.
"""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path
from typing import Any

from .events import KINDS
from .heartbeats import elsewhere, frozen_ranks, pid_alive
from .runs import FINAL_STATES

STALL_MIN_S = 30.0
STALL_FACTOR = 10.0
STEP_TIMES = 50  # step events whose step time makes the median the stall limit uses


def true_step(e: dict[str, Any], step: int) -> int:
    """The step a ``status`` or ``checkpoint`` event says the run is at, else ``step``."""
    value = e.get("step")
    return value if isinstance(value, int) and not isinstance(value, bool) else step


_NUM = (float, int)  # exact types: a JSON number, never a bool
_INF = math.inf


def _number(v: Any) -> bool:
    return type(v) in _NUM


class RunFold:
    """A run's events folded, in file order, into what every reader shows of it."""

    def __init__(self) -> None:
        self.state = "starting"  # the engine's newest word (status.json's is final)
        self.reason = ""
        self.compiling_since: float | None = None  # train.compile: the first step's compile
        self.step = 0
        self.start_step = 0
        self.max_steps: int | None = None
        self.start: dict[str, Any] = {}  # the newest start event
        self.last_step: dict[str, Any] = {}  # the newest step event
        self.loss: float | None = None
        self.best_loss: float | None = None
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES)
        self.first_step_t: float | None = None  # this torchrun group's first step: its rate
        self.first_step = 0
        self.last_step_t: float | None = None
        # The eval in progress (rank 0's ``progress`` events): its batches are signs of life.
        self.eval_progress: dict[str, Any] | None = None
        # The end of the newest eval: a sign of life too, until the next step (the time
        # between an eval's end and the next step or the run's end is no stall).
        self.eval_end_t: float | None = None
        self.restarts = 0
        self.max_restarts: int | None = None
        self.mfu_sum, self.mfu_count = 0.0, 0  # this session's step events with an MFU
        self.samples_sum, self.samples_count = 0.0, 0  # and with samples/s
        self.last_checkpoint: dict[str, Any] | None = None
        self.best_checkpoint: dict[str, Any] | None = None  # checkpoint.keep_best's newest
        self.train_metrics: dict[str, float] = {}  # the task's, newest value of each
        self.skipped: int | None = None  # updates skipped for a non-finite gradient
        self.checkpoint_failed: dict[str, Any] | None = None
        self.checkpointed = True  # a stop's checkpoint was written (the engine's word)
        self.last_t = 0.0  # the newest event's time
        self.events = 0
        self.carried = False  # an earlier session's step or loss stands (carry)

    def apply(self, e: dict[str, Any]) -> None:
        # Called for every event a reader folds (a long run has millions): kept to plain
        # comparisons, no calls beyond ``dict.get``.
        kind = e.get("kind")
        if kind not in KINDS:
            return
        self.events += 1
        t = e.get("t")
        if type(t) in _NUM and t > self.last_t:
            self.last_t = t
        if kind == "step":
            step = e.get("step")
            if type(step) is not int:
                return
            self.step = step
            self.last_step = e
            self.last_step_t = t
            if self.first_step_t is None:
                self.first_step_t, self.first_step = t, step
            loss = self.loss = e.get("loss")
            # A NaN or an infinity is never the best loss (-inf < NaN is False).
            best = self.best_loss
            if type(loss) in _NUM and -_INF < loss < _INF and (best is None or loss < best):
                self.best_loss = loss
            v = e.get("step_time_s")
            if type(v) in _NUM:
                self.step_times.append(v)
            v = e.get("skipped")
            if type(v) is int:
                self.skipped = (self.skipped or 0) + v
            if isinstance(metrics := e.get("metrics"), dict):
                self.train_metrics.update((k, v) for k, v in metrics.items() if _number(v))
            v = e.get("mfu")
            if type(v) in _NUM:
                self.mfu_sum += v
                self.mfu_count += 1
            v = e.get("samples_per_s")
            if type(v) in _NUM:
                self.samples_sum += v
                self.samples_count += 1
        elif kind == "progress":
            if e.get("phase") == "eval":
                self.eval_progress = {k: e.get(k) for k in ("step", "split", "done", "total", "t")}
        elif kind == "eval":
            self.eval_progress = None
            if type(t) in _NUM:
                self.eval_end_t = t
        elif kind == "start":
            self.eval_progress = self.eval_end_t = None
            self.start = e
            self.max_steps = e.get("max_steps")
            self.start_step = self.step = int(e.get("start_step") or 0)
            self.restarts = int(e.get("restart") or 0)
            self.max_restarts = e.get("max_restarts")
            # A new torchrun group (restart or resume) has made no step yet: its own rate.
            self.first_step_t = self.last_step_t = None
            self.step_times.clear()
            if not self.restarts:  # a new session (a launch or a resume)
                self.mfu_sum, self.mfu_count = 0.0, 0
                self.samples_sum, self.samples_count = 0.0, 0
        elif kind == "status":
            self.state = e.get("state", self.state)
            self.reason = e.get("reason") or ""
            since = e.get("since")
            self.compiling_since = (
                (since if type(since) in _NUM else t) if self.state == "compiling" else None
            )
            self.step = true_step(e, self.step)
            if self.state == "stopped":
                self.checkpointed = e.get("checkpointed", True) is not False
        elif kind == "checkpoint":
            # A background write settles after later steps: its step never moves the run back.
            self.step = max(self.step, true_step(e, self.step))
            self.last_checkpoint = e
            if e.get("best") is True:
                self.best_checkpoint = {k: e.get(k) for k in ("path", "step", "metric", "value")}
        elif kind == "log" and isinstance(e.get("checkpoint_failed"), dict):
            self.checkpoint_failed = e["checkpoint_failed"]

    # -- what is derived ---------------------------------------------------------------------
    @property
    def step_time_s(self) -> float | None:
        """The median step time of this torchrun group's last :data:`STEP_TIMES` steps."""
        if not self.step_times:
            return None
        s = sorted(self.step_times)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2

    @property
    def mfu(self) -> float | None:
        return self.last_step.get("mfu")

    @property
    def mfu_not_shown(self) -> str | None:
        return self.start.get("mfu_not_shown")

    def mean_mfu(self) -> float | None:
        return self.mfu_sum / self.mfu_count if self.mfu_count else None

    def mean_samples_per_s(self) -> float | None:
        return self.samples_sum / self.samples_count if self.samples_count else None

    def eta_s(self) -> float | None:
        """The remaining steps at this torchrun group's pace."""
        t0, t1 = self.first_step_t, self.last_step_t
        if not (self.max_steps and _number(t0) and _number(t1)):
            return None
        done = self.step - self.first_step
        if done <= 0 or t1 <= t0:
            return None
        return (t1 - t0) / done * max(0, self.max_steps - self.step)

    def new_session(self, status: dict[str, Any], started: float | None = None) -> bool:
        """A resumed run whose new engine has not spoken yet: every event folded is an
        earlier session's (its end, or a crash's last step), none the one running now.

        ``started``: when meta.json says this session began, for the moment between a
        resume and its new supervisor's first status.json.
        """
        if status.get("ended") or not self.events:
            return False
        started = status.get("started") or started
        return _number(started) and started > self.last_t

    def session_state(
        self, status: dict[str, Any], started: float | None = None
    ) -> tuple[str, str]:
        """(state, reason) with status.json: the supervisor's once the run ended or while a
        new session's engine is silent, else the engine's (ahead of status.json)."""
        if status.get("ended") or self.new_session(status, started):
            return status.get("state") or "starting", status.get("reason") or ""
        return self.state, self.reason

    def to_status(self) -> dict[str, Any]:
        """The fields the supervisor keeps in status.json (``ls`` reads them alone)."""
        out: dict[str, Any] = {"state": self.state, "reason": self.reason}
        # Always written (null once compiled): status.json is updated, not rewritten.
        out["compiling_since"] = self.compiling_since
        if self.best_loss is not None:
            out["best_loss"] = self.best_loss
        if self.skipped is not None:
            out["skipped_updates"] = self.skipped
        if self.carried or self.max_steps is not None:
            out.update(step=self.step, loss=self.loss, max_steps=self.max_steps)
        if not self.events:
            return out
        out.update(step=self.step, loss=self.loss, last_step_t=self.last_step_t)
        if self.step_times:
            out["step_time_s"] = self.step_time_s
        out["eval_progress"] = self.eval_progress
        out["eval_end_t"] = self.eval_end_t
        if self.mfu_count:
            out["mfu"], out["mfu_mean"] = self.mfu, self.mean_mfu()
        if self.start:
            out.update(
                world_size=self.start.get("world_size"),
                max_steps=self.max_steps,
                restarts=self.restarts,
                max_restarts=self.max_restarts,
                mfu_not_shown=self.mfu_not_shown,
            )
        if self.last_checkpoint is not None:
            c = self.last_checkpoint
            out["last_checkpoint"] = {k: c.get(k) for k in ("step", "path", "reason", "t")}
        if self.checkpoint_failed is not None:
            out["checkpoint_failed"] = self.checkpoint_failed
        if self.best_checkpoint is not None:
            out["best_checkpoint"] = self.best_checkpoint
        return out

    def carry(self, previous: dict[str, Any], resume_step: int | None = None) -> None:
        """What a run's earlier sessions leave to this one, from their last status.json
        (a resumed session's supervisor does not reread their events): the best loss, the
        skipped updates, the best checkpoint, and where the run stands until this session's
        engine says otherwise: the step it resumes at (``resume_step``, its checkpoint's,
        else the last session's), its last loss and length. A session that fails before its
        first step still shows the run's step and loss, not ``0/-``."""
        step = resume_step if type(resume_step) is int else previous.get("step")
        if type(step) is int and step > 0:
            self.step = self.start_step = step
            self.carried = True
        loss = previous.get("loss")
        if _number(loss):
            self.loss = loss
            self.carried = True
        length = previous.get("max_steps")
        if type(length) is int:
            self.max_steps = length
        best = previous.get("best_loss")
        if _number(best) and math.isfinite(best):
            self.best_loss = best if self.best_loss is None else min(best, self.best_loss)
        skipped = previous.get("skipped_updates")
        if type(skipped) is int:
            self.skipped = skipped + (self.skipped or 0)
        kept = previous.get("best_checkpoint")
        if self.best_checkpoint is None and isinstance(kept, dict):
            self.best_checkpoint = kept


# -- the state a reader shows ------------------------------------------------------------------


def stall_min_s() -> float:
    """Seconds without a step before a running run is ``stalled`` (``$GPU_CONSOLE_STALL_S``)."""
    try:
        return max(0.1, float(os.environ.get("GPU_CONSOLE_STALL_S", STALL_MIN_S)))
    except ValueError:
        return STALL_MIN_S


def stall_limit_s(step_time_s: float | None) -> float:
    """max(30 s, 10× the median step time): a slow step is not a stall."""
    return max(stall_min_s(), STALL_FACTOR * (step_time_s or 0.0))


class StalledError(Exception):
    """A request that needs a step boundary, to a run that cannot reach one now."""


def derived_state(
    status: dict[str, Any],
    now: float,
    step_time_s: float | None = None,
    run_dir: Path | None = None,
) -> str:
    """The state a reader shows: status.json's, or ``lost`` / ``stalled`` (DESIGN.md).

    ``lost``: status says the run is live but its supervisor is gone. ``stalled``: running,
    but no step (nor eval batch, nor an eval's end) for max(30 s, 10× the median step time,
    which the supervisor keeps in status.json; a reader with its own :class:`RunFold` may
    pass the same median); or, with ``run_dir``, in any live state, a rank whose heartbeat
    has been silent for the stall minimum (a rank frozen in start-up has made no step to be
    late for).
    """
    state = status.get("state", "starting")
    if status.get("ended") or state in FINAL_STATES:
        return state
    # A session on another machine: its pids mean nothing here (its own host judges it).
    if not elsewhere(status) and not pid_alive(status.get("pids", {}).get("supervisor")):
        return "lost"
    last = status.get("last_step_t")
    evaluating = status.get("eval_progress") or {}
    if type(evaluating.get("t")) in _NUM:  # an eval batch is a sign of life, like a step
        last = max(last or 0.0, evaluating["t"])
    if type(ended := status.get("eval_end_t")) in _NUM:  # and so is an eval's end
        last = max(last or 0.0, ended)
    limit = stall_limit_s(step_time_s or status.get("step_time_s"))
    if state == "running" and last and now - last > limit:
        return "stalled"
    if run_dir is not None and frozen_ranks(run_dir, now, stall_min_s(), status.get("started")):
        return "stalled"
    return state


def shown_state(
    fold: RunFold,
    status: dict[str, Any],
    now: float,
    started: float | None = None,
    run_dir: Path | None = None,
) -> str:
    """The state every console shows for a run: the fold's with status.json, and ``lost`` or
    ``stalled`` as :func:`derived_state` finds them (``started``: see ``new_session``;
    ``run_dir``: where the heartbeats are)."""
    state, _ = fold.session_state(status, started)
    if not status or status.get("ended"):
        return state
    derived = derived_state(status, now, fold.step_time_s, run_dir)
    return derived if derived in ("lost", "stalled", *FINAL_STATES) else state
