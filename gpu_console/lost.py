"""A run whose supervisor died without recording an end: the next reader records ``lost``.

A supervisor killed outright (SIGKILL, the OOM killer, a reboot) leaves status.json saying
``running`` at the step of its last tick. Deriving ``lost`` in each reader left every view
with its own step; so the first reader that finds the run over records it, once, in
status.json itself: under the session lock (:mod:`.session_lock`: it can be taken only when
no session is live, and it keeps a resume from starting meanwhile), with the step and loss
of THE fold (:mod:`.fold`) over the session's events, ``ended`` and exit code 1. Every later
reader (``ls``, ``status``, the consoles, ``--resume``) then reads the same record.

status.json is a cache of what the run directory holds: where the events end in an end the
engine itself wrote (``finished``, ``stopped``, ``failed``, ``refused``), a reader that finds
status.json unended, damaged or missing records that end instead (``repaired``; ``ended``:
the end event's time), never a worse answer. A reader that cannot write the run directory
(a read-only mount or copy) derives the same end and shows it, writing nothing. No torch
here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from . import session_lock
from .events import JsonlTail
from .fold import RunFold
from .heartbeats import elsewhere, pid_alive
from .runs import (
    EXIT_FAILED,
    STATUS,
    current_session,
    exit_code,
    previous_status,
    read_json,
    read_status,
    resume_step,
    write_status,
)

LOST_REASON = "the supervisor exited without recording an end"
# The ends the engine itself records in events.jsonl (trainer.py, loop.py): a reader that
# finds one needs no supervisor to know how the run ended.
ENGINE_ENDS = ("finished", "stopped", "failed", "refused")
READER_WAIT_S = 1.0


def settle(run_dir: Path, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """status.json as it stands; or, when the run's supervisor is gone without recording an
    end, status.json with ``lost`` recorded in it by this reader."""
    run_dir = Path(run_dir)
    status = read_status(run_dir) if status is None else status
    if status.get("ended") or _processes_left(status) or elsewhere(status):
        return status
    legacy = not (run_dir / session_lock.LOCK).exists()
    if legacy and (not status or pid_alive(_pids(status).get("supervisor"))):
        # A run made before the lock: its supervisor's pid is all there is (and without a
        # status.json, nothing says a session ever ran: it is left as found).
        return status
    lock = _take(run_dir, legacy, pid_alive(_pids(status).get("supervisor")))
    if lock is None:
        return read_status(run_dir)  # a session holds the run: it is live (or starting)
    if lock is UNWRITABLE:
        # A read-only run directory (a read-only mount, a copy without write permission):
        # no session can hold it and nothing can be recorded, so the end is derived as the
        # recording reader would derive it, and shown: never a damaged file's answer.
        return record_lost(run_dir, write=False)
    with lock:
        return record_lost(run_dir)


# What :func:`_take` returns for a run directory this reader cannot write (nor lock in it).
UNWRITABLE = object()


def _take(run_dir: Path, legacy: bool, supervisor_alive: bool) -> Any:
    """The run's lock, if no session holds it (None if one does, :data:`UNWRITABLE` where the
    run directory cannot be written). Where status.json's supervisor is gone, the holder may
    be another reader recording the end this moment: it is given a moment (its record is then
    read, not written again)."""
    deadline = time.monotonic() + (0.0 if supervisor_alive else READER_WAIT_S)
    while True:
        try:
            lock = session_lock.try_take(run_dir, create=legacy)
        except OSError:  # a read-only run directory: nothing can be recorded
            return None if _held_read_only(run_dir) else UNWRITABLE
        if lock is not None or time.monotonic() >= deadline:
            return lock
        time.sleep(0.05)


def _held_read_only(run_dir: Path) -> bool:
    """Whether a session holds the lock of a run directory this reader cannot write: asked
    through a read-only descriptor (flock needs no write access). A lock file that cannot
    be opened at all: no session could take it either."""
    try:
        fd = os.open(run_dir / session_lock.LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a session holds it
        return True
    finally:
        os.close(fd)  # and a shared lock taken with it
    return False


def record_lost(run_dir: Path, write: bool = True) -> dict[str, Any]:
    """Record the run's end in status.json unless it says the run ended: the end the engine
    wrote in events.jsonl (:data:`ENGINE_ENDS`), else ``lost``; the caller holds the
    session lock. Returns status.json as it now stands. ``write=False``: a run directory
    that cannot be written: the same end, derived and returned, nothing written."""
    status = read_status(run_dir)  # again, under the lock: another reader may have been first
    if status.get("ended"):
        return status
    meta = read_json(run_dir / "meta.json")
    session = current_session(meta) if isinstance(meta, dict) else {}
    start = session.get("events_from")
    fold = RunFold()
    # What the earlier sessions left, as the supervisor carried it: their last status.json,
    # not this one (which already counts this session's skips, folded again below).
    sessions = meta.get("sessions") if isinstance(meta, dict) else None
    fold.carry(previous_status(run_dir, sessions), resume_step(session))
    for e in JsonlTail(run_dir / "events.jsonl", start if isinstance(start, int) else 0).read():
        fold.apply(e)
    status.update(fold.to_status())
    # Its last sign of life (the newest event, or its last status.json), not this read.
    ended = max(fold.last_t, _mtime(run_dir / STATUS), _number(status.get("started")))
    recorded = {"t": time.time(), "pid": os.getpid()}
    if fold.state in ENGINE_ENDS:
        # The engine recorded its own end in the events (status.json damaged, deleted, or
        # its supervisor killed after the ranks had finished): that end stands, repaired
        # into status.json, never overwritten with a worse answer; and when: the end
        # event's time, not when the damaged file was last touched.
        checkpointed = fold.state == "stopped" and fold.checkpointed
        status.update(
            ended=fold.state_t if fold.state_t is not None else ended,
            exit_code=exit_code(fold.state, checkpointed),
            checkpointed_on_stop=checkpointed,
        )
        if write:
            status["repaired"] = {**recorded, "from": "events.jsonl"}
    else:
        status.update(
            state="lost",
            reason=LOST_REASON,
            ended=ended,
            exit_code=EXIT_FAILED,
            checkpointed_on_stop=False,
        )
        if write:
            status["lost_recorded"] = recorded
    status.setdefault("pids", {})["workers"] = []
    status.setdefault("started", session.get("started"))
    if write:
        # Unwritable after all (a full disk): every reader still derives the same end.
        with contextlib.suppress(OSError):
            write_status(run_dir, status)
    return status


def _pids(status: dict[str, Any]) -> dict[str, Any]:
    pids = status.get("pids")
    return pids if isinstance(pids, dict) else {}


def _processes_left(status: dict[str, Any]) -> bool:
    """torchrun or a rank still alive (they die with the supervisor, a moment later): their
    last events are not written yet, so the end is recorded by a later reader."""
    return bool(live_pids(status, supervisor=False))


def live_pids(status: dict[str, Any], supervisor: bool = True) -> list[int]:
    """The run's processes status.json names that are alive here (a zombie is not)."""
    pids = _pids(status)
    workers = pids.get("workers") if isinstance(pids.get("workers"), list) else []
    named = [pids.get("supervisor")] if supervisor else []
    return [p for p in [*named, pids.get("torchrun"), *workers] if pid_alive(p)]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0
