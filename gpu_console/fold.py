"""THE fold of a run's events into its state: every reader of a run uses this one.

The supervisor writes ``status.json`` from it (so ``ls`` reads it), the headless console's
:class:`~gpu_console.state.RunState` and the run screen's model extend it with what only they
show. One rule each, so that they never disagree on the same events:

- step: the newest step event's, else the true step a ``checkpoint`` or ``status`` event
  carries (log steps may be far apart), else a ``start``'s ``start_step``;
- best loss: the lowest finite loss over every session of the run (a NaN is never best);
- best checkpoint: the newest checkpoint event marked ``best`` (``checkpoint.keep_best``);
- stall: decided in :mod:`.stall` for every reader (no rank advanced for max(30 s, 10 × the
  time per step), judged from the ranks' heartbeats per step; or a frozen heartbeat); the
  fold keeps the events' signs it reads: the newest step's and eval batch's time, an eval's
  end, when the run last began or resumed ``running``, the steps between step events;
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
from collections import deque
from pathlib import Path
from typing import Any

from .events import KINDS
from .heartbeats import elsewhere, pid_alive
from .runs import FINAL_STATES

# The stall's rule lives in stall.py; its names stay importable from here.
from .stall import STALL_FACTOR, STALL_MIN_S, stall_limit_s, stall_min_s, stalled  # noqa: F401

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
        self.log_steps: int | None = None  # steps between the two newest step events
        # When the run last became ``running`` (its start, a compile's end, a pause's end):
        # a sign of life until the next step, which may be a log interval away.
        self.running_since: float | None = None
        # The eval in progress (rank 0's ``progress`` events): its batches are signs of life.
        self.eval_progress: dict[str, Any] | None = None
        # The end of the newest eval: a sign of life too, until the next step (the time
        # between an eval's end and the next step or the run's end is no stall).
        self.eval_end_t: float | None = None
        self.restarts = 0
        self.max_restarts: int | None = None
        self.mfu_sum, self.mfu_count = 0.0, 0  # this session's step events with an MFU
        self.samples_sum, self.samples_count = 0.0, 0  # and with samples/s
        # Each whole epoch's wall time (``epoch`` events; a later session's word for an epoch
        # wins: a restart that trains it again, or a resume that joins it mid-way).
        self.epoch_seconds: dict[int, float] = {}
        self.last_checkpoint: dict[str, Any] | None = None
        self.best_checkpoint: dict[str, Any] | None = None  # checkpoint.keep_best's newest
        self.train_metrics: dict[str, float] = {}  # the task's, newest value of each
        self.skipped: int | None = None  # updates skipped for a non-finite gradient
        self.checkpoint_failed: dict[str, Any] | None = None
        self.checkpointed = True  # a stop's checkpoint was written (the engine's word)
        self.last_t = 0.0  # the newest event's time
        self.state_t: float | None = None  # the newest status event's time (an end's: when)
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
            before = self.last_step.get("step")
            if type(before) is int and step > before:
                self.log_steps = step - before
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
            self.first_step_t = self.last_step_t = self.running_since = None
            self.step_times.clear()
            if not self.restarts:  # a new session (a launch or a resume)
                self.mfu_sum, self.mfu_count = 0.0, 0
                self.samples_sum, self.samples_count = 0.0, 0
        elif kind == "status":
            self.state = e.get("state", self.state)
            self.reason = e.get("reason") or ""
            if type(t) in _NUM:
                self.state_t = t
            since = e.get("since")
            self.compiling_since = (
                (since if type(since) in _NUM else t) if self.state == "compiling" else None
            )
            if self.state == "running" and type(t) in _NUM:
                self.running_since = t
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
        elif kind == "epoch":
            epoch, seconds = e.get("epoch"), e.get("seconds")
            if type(epoch) is int:
                if e.get("whole") is True and type(seconds) in _NUM:
                    self.epoch_seconds[epoch] = seconds
                else:
                    self.epoch_seconds.pop(epoch, None)

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

    def epoch_time(self) -> dict[str, float | int] | None:
        """The mean wall time of the run's whole epochs and how many, or None before one."""
        times = self.epoch_seconds.values()
        return {"mean_s": sum(times) / len(times), "epochs": len(times)} if times else None

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
        out.update(running_since=self.running_since, log_steps=self.log_steps)
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
        else the last session's), its last loss, length and log interval. A session that
        fails before its first step still shows the run's step and loss, not ``0/-``."""
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
        # The log interval until this session's second step event measures its own: a
        # reader without heartbeats judges a stall by it (stall.py) from the first one on.
        every = previous.get("log_steps")
        if self.log_steps is None and type(every) is int and every > 0:
            self.log_steps = every


# -- the state a reader shows ------------------------------------------------------------------


class StalledError(Exception):
    """A request that needs a step boundary, to a run that cannot reach one now."""


def derived_state(
    status: dict[str, Any],
    now: float,
    step_time_s: float | None = None,
    run_dir: Path | None = None,
    fold: RunFold | None = None,
) -> str:
    """The state a reader shows: status.json's, or ``lost`` / ``stalled`` (DESIGN.md).

    ``lost``: status says the run is live but its supervisor is gone. ``stalled``: as
    :func:`.stall.stalled` decides, from status.json's signs (``step_time_s``: a reader's
    own median of the step times, else status.json's) and, with ``run_dir``, the ranks'
    heartbeats. ``fold``: a reader's own fold of the events, ahead of status.json (the
    supervisor writes it a tick later): its signs count with status.json's, and a run is
    judged ``running`` only where its state says so too (a pause the supervisor has not
    written yet is no stall).
    """
    state = status.get("state", "starting")
    if status.get("ended") or state in FINAL_STATES:
        return state
    # A session on another machine: its pids mean nothing here (its own host judges it).
    if not elsewhere(status) and not pid_alive(status.get("pids", {}).get("supervisor")):
        return "lost"
    view = status
    if fold is not None and fold.events:
        view = {**status, **_signs(fold, status)}
    # Running is judged where both say so: the engine's newer word (paused) vetoes it.
    judged = fold.state if fold is not None and fold.events and state == "running" else state
    if stalled(judged, view, now, step_time_s or status.get("step_time_s"), run_dir):
        return "stalled"
    return state


def with_signs(fold: RunFold, status: dict[str, Any]) -> dict[str, Any]:
    """status.json with a reader's own fold's newer signs of progress: what the stall
    verdict judged, so "no step for N s" counts from the same sign."""
    return {**status, **_signs(fold, status)}


def _signs(fold: RunFold, status: dict[str, Any]) -> dict[str, Any]:
    """The fold's signs of progress where they are newer than status.json's."""
    out: dict[str, Any] = {}
    for key in ("last_step_t", "eval_end_t", "running_since"):
        mine, theirs = getattr(fold, key), status.get(key)
        if _number(mine) and not (_number(theirs) and theirs >= mine):
            out[key] = mine
    if fold.eval_progress is not None or fold.eval_end_t is not None:
        out["eval_progress"] = fold.eval_progress
    if fold.log_steps is not None:
        out["log_steps"] = fold.log_steps
    return out


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
    # A resumed session whose engine has not spoken: the fold's events are an earlier one's.
    own = None if fold.new_session(status, started) else fold
    derived = derived_state(status, now, fold.step_time_s, run_dir, own)
    return derived if derived in ("lost", "stalled", *FINAL_STATES) else state
