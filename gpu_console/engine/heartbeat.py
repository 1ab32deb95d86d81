"""Per-rank heartbeat: ``heartbeats/rank-NNNNN.json``, one small file per rank.

The training loop only records where it is (:meth:`Heartbeat.set`: step and phase, a few
attribute stores); a daemon thread writes that to the rank's file about once a second, in
place (one ``pwrite`` of a fixed-size record, so the file never shrinks or grows). Readers
(the console's ``stalled`` state, ``gpu-console dump``, the supervisor) learn from it:

- ``t``: when the thread last wrote. A rank whose thread went quiet is frozen (stopped,
  wedged holding the interpreter) or gone.
- ``step`` / ``phase`` / ``detail`` / ``since``: where the loop is and since when (``detail``:
  the eval's batch, ``120/400``, else empty). ``step`` is the step
  in progress in ``data``/``compute``/``update``, the step just completed in the later
  phases, so (step, phase) grows monotonically. In a hang, the rank furthest behind is the
  one that stopped; the others wait for it in a collective.
- ``moved``: when the rank last advanced (a new step, or a new eval batch); null before it
  has. ``step_s``: the rank's own time per step (a moving average of the time from one
  step's start to the next's, left out for the rank's first step and where a pause, an eval
  or a checkpoint came between them); null until it has a step to measure. A reader judges
  a stall from these, per step, whatever the log interval (``gpu_console/stall.py``); both
  are kept by :meth:`Heartbeat.set`, which the loop calls anyway: no write, no collective.
- ``eval_s``: the rank's own time per eval batch in the eval (the split) in progress,
  measured the same way from one batch's start to the next's; null during its first batch.
  An eval batch is judged against it, not against a training step (a batch that samples
  1,280 tours of each instance is minutes where a step is a second), and never against
  another eval's: the cvrp task's end eval samples forty times more than the evals before it.

This is not a writer of ``events.jsonl`` (rank 0 alone writes that). No torch here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Protocol

from .. import strict_json
from ..heartbeats import DIR, ENDED, PHASES  # noqa: F401 - the file's contract, one place

INTERVAL_S = 1.0
RECORD_BYTES = 512
# A step's time reaches ``step_s`` at this weight: a few steps follow a change of pace, and
# one slow step (a data loader's hiccup) moves it little.
STEP_S_WEIGHT = 0.2
# Phases between two steps that are not the step's own work: a gap spanning one is not
# measured (a pause's minutes, an eval, a checkpoint would pass for a slow step).
NOT_A_STEP = frozenset(("paused", "eval", "checkpoint"))


def path_for(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank-{rank:05d}.json"


class Beat(Protocol):
    """What the engine's parts tell a rank's heartbeat: a :class:`Heartbeat`, or loop.py's
    stand-in where a rank has none."""

    step: int
    phase: str

    def set(self, step: int, phase: str, detail: str = "") -> None: ...


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, local_rank: int, restart: int):
        self.rank, self.local_rank, self.restart = rank, local_rank, restart
        self.step = 0
        self.phase = "starting"
        self.detail = ""  # within the phase: the eval's batch (``120/400``)
        self.since = time.time()
        self.moved: float | None = None  # when the rank last advanced: a step, an eval batch
        self.step_s: float | None = None  # the rank's time per step, measured
        self.eval_s: float | None = None  # the rank's time per eval batch, measured
        self._batch_t: float | None = None  # when the eval batch in progress began
        self._step_t: float | None = None  # when the step in progress began
        self._measurable = False  # nothing but the step's own work since it began
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        path = path_for(run_dir, rank)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._write()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def set(self, step: int, phase: str, detail: str = "") -> None:
        """Where the loop is now. Cheap: called several times a step."""
        now = time.time()
        if step != self.step:
            self._advanced(step, now)
        elif detail and detail != self.detail:  # the eval's next batch
            self._next_batch(phase, detail, now)
            self.moved = now
        if phase == "eval" and not detail:  # an eval begins: its own batches' time, not yet
            self._batch_t = self.eval_s = None
        if phase in NOT_A_STEP:
            self._measurable = False
        self.step = step
        self.phase = phase
        self.detail = detail
        self.since = now

    def _advanced(self, step: int, now: float) -> None:
        """A new step began (once a step): the last one's time into ``step_s``."""
        if step == self.step + 1 and self._measurable and self._step_t is not None:
            took = now - self._step_t
            s = self.step_s
            self.step_s = took if s is None else s + STEP_S_WEIGHT * (took - s)
        # A rank's first step (warm-up, a compile) is not its pace: measured from the next.
        self._measurable = self._step_t is not None
        self._step_t = self.moved = now

    def _next_batch(self, phase: str, detail: str, now: float) -> None:
        """An eval batch began: the one before it in this eval's split (if any) into
        ``eval_s``. A new split (``val 3/8`` → ``test 0/8``) times its own batches."""
        if phase != "eval":
            return
        split = detail.rpartition(" ")[0]
        same = self.phase == "eval" and self.detail and self.detail.rpartition(" ")[0] == split
        if same and self._batch_t is not None:
            took = now - self._batch_t
            s = self.eval_s
            self.eval_s = took if s is None else s + STEP_S_WEIGHT * (took - s)
        elif not same:
            self.eval_s = None
        self._batch_t = now

    def _record(self) -> bytes:
        doc = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "host": self._host,
            "restart": self.restart,
            "step": self.step,
            "phase": self.phase,
            "detail": self.detail,
            "since": round(self.since, 3),
            "moved": None if self.moved is None else round(self.moved, 3),
            "step_s": None if self.step_s is None else round(self.step_s, 4),
            "eval_s": None if self.eval_s is None else round(self.eval_s, 4),
            "t": round(time.time(), 3),
        }
        data = strict_json.dumps(doc, separators=(",", ":")).encode()
        return data.ljust(RECORD_BYTES - 1)[: RECORD_BYTES - 1] + b"\n"

    def _write(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            # A full disk must not take the rank down for a heartbeat.
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, self._record(), 0)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._write()

    def close(self, phase: str) -> None:
        """Record how the rank ended (``done`` or ``failed``), synchronously."""
        self._stop.set()
        self.set(self.step, phase)
        self._write()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
