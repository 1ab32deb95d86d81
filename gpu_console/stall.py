"""Whether a live run is stalled: the one decision ``ls``, ``status``, ``stop``, the headless
console and the run screen all take (through :func:`.fold.derived_state`). No torch.

A run is stalled when

- it is ``running`` and no rank has advanced (a step, an eval batch) for
  max(:func:`stall_min_s`, :data:`STALL_FACTOR` × its time per step). The ranks' heartbeats
  say when each last advanced (``moved``) and their own time per step (``step_s``), so the
  judgement is per step whatever the log interval: a run logging every 50 fast steps is
  not stalled between its step events. The time per step is the larger of the heartbeats'
  and the step events' median (a slow step is never a stall). Where no heartbeat says it
  (a reader on a machine that cannot see them, an engine older than them, a rank still in
  its first step), the events stand in for it, and their limit is a log interval's:
  :data:`STALL_FACTOR` × the time per step × the steps between step events;
  while a rank evaluates, the time per eval batch (the heartbeats' ``eval_s``, this eval's
  own) counts as a step's: an eval batch may take minutes where a step takes a second. An
  eval's first batch, whose time nobody knows yet (another eval's may be forty times
  shorter), is judged as a first step is: only by the second rule;
- or, in any live state, a live rank's heartbeat thread has been silent for
  :func:`stall_min_s` (:func:`.heartbeats.frozen_ranks`: it writes every second whatever
  the rank does, so a long phase is never a stall while it beats).

A pause is never a stall: a ``paused`` run is not ``running``, a rank whose heartbeat still
says ``paused`` has just been resumed, and the ``running`` status event that ends a pause
is a sign of life itself, so the moment between resuming and the next step is not a stall
either, nor does the pause's time count as a step's.

:data:`STALL_FACTOR` is 10: a step ten times slower than the run's pace is what a stuck
collective or data loader looks like, while steps that vary two- or threefold (variable
lengths, a periodic sync) never reach it. The floor, :data:`STALL_MIN_S` (30 s,
``$GPU_CONSOLE_STALL_S``), keeps fast runs from flagging a hiccup of the machine (a
swap, a slow file system for a few seconds) as a stall.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .heartbeats import ENDED, frozen_ranks, read_heartbeats

STALL_MIN_S = 30.0
STALL_FACTOR = 10.0


def stall_min_s() -> float:
    """Seconds without progress before a running run is ``stalled`` at the least
    (``$GPU_CONSOLE_STALL_S``)."""
    try:
        return max(0.1, float(os.environ.get("GPU_CONSOLE_STALL_S", STALL_MIN_S)))
    except ValueError:
        return STALL_MIN_S


def stall_limit_s(step_time_s: float | None, steps: int = 1) -> float:
    """max(the floor, 10× the time of ``steps`` steps): a slow step is not a stall."""
    return max(stall_min_s(), STALL_FACTOR * (step_time_s or 0.0) * max(1, steps))


def _number(v: Any) -> bool:
    return type(v) in (float, int)


def _newest(*values: Any) -> float | None:
    found = [v for v in values if _number(v)]
    return max(found) if found else None


def last_sign_t(view: dict[str, Any]) -> float | None:
    """The newest sign of progress in the events: a step, an eval batch, an eval's end, or
    the ``running`` status that began or resumed the running (``view``: status.json's
    fields, or the same from a reader's own fold)."""
    evaluating = view.get("eval_progress")
    batch = evaluating.get("t") if isinstance(evaluating, dict) else None
    step, running = view.get("last_step_t"), view.get("running_since")
    return _newest(step, batch, view.get("eval_end_t"), running)


def session_beats(beats: list[dict[str, Any]], started: Any) -> list[dict[str, Any]]:
    """The live ranks' heartbeats of this session (a record older than its start is an
    earlier session's)."""
    return [
        b
        for b in beats
        if b.get("phase") not in ENDED
        and _number(b.get("t"))
        and not (_number(started) and b["t"] < started)
    ]


def _paused_turns(beat: dict[str, Any], now: float, floor: float) -> bool:
    since = beat.get("since")
    return not isinstance(since, (int, float)) or now - since <= floor


def no_progress(
    view: dict[str, Any],
    now: float,
    step_time_s: float | None,
    beats: list[dict[str, Any]] | None,
) -> bool:
    """A running run in which nothing advanced for too long (the first rule above).

    ``view``: the run's fields as status.json holds them (``state`` ``running`` is the
    caller's to check); ``step_time_s``: the step events' median; ``beats``: the ranks'
    heartbeats, or None where they cannot be read."""
    live = session_beats(beats or [], view.get("started"))
    # Paused, or resumed a moment ago and the heartbeat has yet to say so. A paused rank sets
    # its phase every control turn: one that stopped doing so is stuck in the turn itself.
    floor = stall_min_s()
    if any(b.get("phase") == "paused" and _paused_turns(b, now, floor) for b in live):
        return False
    last = last_sign_t(view)
    moved = _newest(*(b.get("moved") for b in live))
    paces = [b["step_s"] for b in live if _number(b.get("step_s"))]
    if any(b.get("phase") == "eval" for b in live):
        batches = [b["eval_s"] for b in live if _number(b.get("eval_s"))]
        since = _newest(last, moved)
        if not batches or since is None:
            return False  # an eval's first batch: not timed yet, as a first step
        return now - since > stall_limit_s(max([step_time_s or 0.0, *paces, *batches]))
    if moved is not None and paces:
        per_step = max([step_time_s or 0.0, *paces])
        since = _newest(last, moved)
        assert since is not None  # moved is a number
        return now - since > stall_limit_s(per_step)
    if last is None:
        return False  # not a step yet: only a frozen heartbeat says a stall
    gap = view.get("log_steps")
    return now - last > stall_limit_s(step_time_s, gap if type(gap) is int else 1)


def stalled(
    state: str,
    view: dict[str, Any],
    now: float,
    step_time_s: float | None = None,
    run_dir: Path | None = None,
) -> bool:
    """Whether a run in the live ``state`` is stalled (the module's two rules). ``run_dir``:
    where its heartbeats are; without it, the events alone judge."""
    beats = read_heartbeats(run_dir) if run_dir is not None else None
    if state == "running" and no_progress(view, now, step_time_s, beats):
        return True
    started = view.get("started")
    return run_dir is not None and bool(frozen_ranks(run_dir, now, stall_min_s(), started))


def quiet_s(view: dict[str, Any], now: float, run_dir: Path | None = None) -> float | None:
    """Seconds since the run last advanced (the newest of the heartbeats' ``moved`` and the
    events' signs): the "no step for N s" of a stall; None before any sign."""
    beats = session_beats(read_heartbeats(run_dir), view.get("started")) if run_dir else []
    last = _newest(last_sign_t(view), *(b.get("moved") for b in beats))
    return None if last is None else max(0.0, now - last)
