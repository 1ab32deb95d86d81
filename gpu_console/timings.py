"""Where a run's start-up time goes: wall-clock stages from the command to the first step.

Each process of the launch chain stamps its own stages and hands them on: the console
records when the command started (``launched``, in meta.json's session), the supervisor
puts its stages in the environment torchrun and the ranks inherit (:data:`ENV`), and the
rank that writes events adds its own and reports them all, as seconds since ``launched``:

- the ``start`` event's ``timings``: ``{"launched": <unix time>, "stages": {STAGE: s, ...}}``,
  the stages of :data:`STAGES` in order;
- the first ``step`` event of the session (``log_every`` steps later): ``{"first_step": s}``,
  taken when the first optimizer step of the session was done.

Readers skip fields they do not know. No torch here (the console and the supervisor use it).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from . import FIRST_IMPORT

ENV = "GPU_CONSOLE_TIMINGS"  # {"supervisor": t, "torchrun": t}: unix times, from the supervisor
STAGES = (
    "created",  # the console made the run directory; meta.json, then the supervisor, next
    "supervisor",  # the supervisor's code runs (its interpreter and imports done)
    "torchrun",  # the supervisor starts torchrun
    "rank",  # the rank's first line (torchrun imported torch, rendezvoused, spawned it)
    "imports",  # the rank imported torch, the engine and the task
    "process_group",  # init_process_group returned (rendezvous of the ranks, gloo/NCCL)
    "built",  # model, optimizer, datasets and loaders built (and a resume's state loaded)
    "ddp",  # FLOPs counted, DDP wrapped: the loop starts
)
FIRST_STEP = "first_step"


def process_start_time() -> float:
    """When this command started, as a unix time: before its interpreter and imports ran.

    From /proc (its start in clock ticks since boot, against the boot-time clock now: 10 ms
    steps; psutil's figure can be a second off, its boot time is whole seconds). Elsewhere:
    now. /proc's start is the fork's, and a shell's last command may be exec'd in the shell's
    own process (``pip install … && gpu-console run …`` in a script, ``ssh host '…'``): then
    it is the shell's start, minutes before the command. Where the process waited far longer
    before reaching gpu-console's code than its interpreter works (:func:`_exec_late`), the
    command started when its interpreter did: the first import less the CPU used by then.
    """
    now = time.time()
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    started = now - age if 0 <= age < 3600 else now
    first_import, cpu = FIRST_IMPORT
    if _exec_late(first_import - started, cpu):
        return first_import - cpu
    return started


EXEC_GAP_S = 3.0  # an interpreter reaches our first import well within this, busy or not...
WAITED_OVER_WORKED = 20.0  # ...unless the machine is this far oversubscribed


def _exec_late(waited: float, cpu: float) -> bool:
    """From the fork to gpu-console's first import, the process mostly waited: a shell that
    ran other commands (pip) before exec'ing this one, not an interpreter starting."""
    return waited > EXEC_GAP_S and waited > WAITED_OVER_WORKED * cpu


def handed_down(stages: dict[str, float]) -> dict[str, str]:
    """``os.environ`` with ``stages`` (unix times) added to what it already hands down."""
    return dict(os.environ, **{ENV: json.dumps(inherited() | stages)})


def inherited() -> dict[str, float]:
    """The stages earlier processes put in the environment."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        found = json.loads(os.environ.get(ENV, "{}"))
        return {str(k): float(v) for k, v in found.items()}
    return {}


class Stopwatch:
    """A rank's stages: :meth:`mark` each as it is reached; the writer reports them."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.session: dict[str, Any] = {}  # meta.json's session: when the command started
        self._first_step_reported = False

    def mark(self, stage: str) -> None:
        self.marks.setdefault(stage, time.time())

    def step_done(self) -> None:
        """After each optimizer step: the first one is a stage."""
        if FIRST_STEP not in self.marks:
            self.marks[FIRST_STEP] = time.time()

    def _launched(self, known: dict[str, Any]) -> float:
        """The command's start; a run launched before sessions recorded it: ``started``."""
        for t in (self.session.get("launched"), self.session.get("started")):
            if isinstance(t, (int, float)):
                return float(t)
        return min((t for t in known.values() if isinstance(t, float)), default=time.time())

    def start_fields(self) -> dict[str, Any]:
        """The start event's ``timings``."""
        known = {"created": self.session.get("started"), **inherited(), **self.marks}
        launched = self._launched(known)
        stages = {
            s: round(t - launched, 3) for s in STAGES if isinstance(t := known.get(s), (int, float))
        }
        return {"timings": {"launched": launched, "stages": stages}}

    def first_step_fields(self) -> dict[str, Any]:
        """The first step event's ``timings``; nothing for the later ones."""
        t = self.marks.get(FIRST_STEP)
        if t is None or self._first_step_reported:
            return {}
        self._first_step_reported = True
        return {"timings": {FIRST_STEP: round(t - self._launched(self.marks), 3)}}
