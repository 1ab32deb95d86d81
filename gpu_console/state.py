"""RunState: a run's events, status and telemetry folded into what a console shows (no torch)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# The writer defines the file format; it imports no torch, so the console may read it here.
from .events import JsonlTail

# THE fold (one for every reader of a run) and the states derived from it, re-exported here.
from .fold import (  # noqa: F401
    STALL_FACTOR,
    STALL_MIN_S,
    RunFold,
    derived_state,
    pid_alive,
    shown_state,
    stall_limit_s,
    stall_min_s,
    true_step,
)
from .heartbeats import (
    ENDED,
    read_heartbeats,  # noqa: F401 - the readers' import of it
)
from .heartbeats import PHASES as PHASE_ORDER
from .runs import FINAL_STATES, current_session, read_json, read_status, status_exit_code

# What each GPU of the run did: the telemetry fold lives beside its writer (telemetry/).
from .telemetry.fold import TELEMETRY_FILE, GpuFigures, TelemetryFold, gpu_figures  # noqa: F401

# A rank's heartbeat thread writes about once a second; this much silence means it is frozen.
HEARTBEAT_SILENT_S = 5.0


def _progress(beat: dict[str, Any]) -> tuple[int, int]:
    phase = beat.get("phase")
    order = PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)
    return int(beat.get("step") or 0), order


def stopped_ranks(beats: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The ranks that stopped, with why, for a stalled run (best guess, from heartbeats).

    A rank whose heartbeat thread went silent is frozen or gone. Otherwise, in lock-step
    training the rank furthest behind (an earlier step, or an earlier phase of it) is the one
    stuck; its peers wait for it in a collective. When all are at the same point (a hang
    inside a collective, or a deadlock in the same phase on every rank) all are named.
    """
    live = [b for b in beats if b.get("phase") not in ENDED]
    if not live:
        return []
    silent = [b for b in live if now - float(b.get("t") or 0) > HEARTBEAT_SILENT_S]
    if silent:
        return [{**b, "why": "heartbeat silent"} for b in silent]
    behind = min(_progress(b) for b in live)
    return [{**b, "why": "behind"} for b in live if _progress(b) == behind]


def describe_stopped(beats: list[dict[str, Any]], now: float) -> str:
    """``rank 1 (step 12, data, 42 s)``: what a console prints about stopped ranks."""
    parts = []
    for b in stopped_ranks(beats, now):
        if b["why"] == "heartbeat silent":
            ago = now - float(b.get("t") or 0)
            parts.append(f"rank {b['rank']} (no heartbeat for {ago:.0f} s)")
        else:
            since = now - float(b.get("since") or now)
            phase = " ".join(str(x) for x in (b.get("phase"), b.get("detail")) if x)
            parts.append(f"rank {b['rank']} (step {b.get('step')}, {phase}, for {since:.0f} s)")
    return ", ".join(parts)


class RunState(RunFold):
    """The shared fold (:mod:`.fold`) with what the headless console also shows: evals,
    checkpoints, peak memory per rank, logs, controls, status.json and the GPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.ended_t: float | None = None
        self.eval: dict[str, float] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.peak_memory: dict[int, int] = {}
        self.logs: list[dict[str, Any]] = []
        self.controls: list[dict[str, Any]] = []
        self.profiles: list[dict[str, Any]] = []  # the profile command's traces
        self.status: dict[str, Any] = {}
        self.gpus: list[dict[str, Any]] = []  # per GPU: TelemetryFold.gpus()
        self.session_started: float | None = None  # meta.json's, for a resumed run
        self.run_dir: Path | None = None  # where the ranks' heartbeats are (a stall's sign)
        # This session's engine has started (its start event was read): until then the
        # figures (step, max_steps, rate) are a resumed run's earlier session's.
        self.session_began = False

    def apply(self, e: dict[str, Any]) -> None:
        super().apply(e)
        kind = e.get("kind")
        if kind == "step":
            for m in e.get("memory") or []:
                r = m.get("rank")
                self.peak_memory[r] = max(self.peak_memory.get(r, 0), int(m.get("peak") or 0))
        elif kind == "eval":
            self.eval = {k: v for k, v in e.items() if k not in ("v", "t", "kind", "step")}
        elif kind == "checkpoint":
            self.checkpoints.append(e)
        elif kind == "log":
            self.logs.append(e)
        elif kind == "control":
            self.controls.append(e)
        elif kind == "profile":
            self.profiles.append(e)

    def apply_status(self, status: dict[str, Any]) -> None:
        """The supervisor's word is final once the run has ended, and stands for a resumed
        session until its engine speaks (:meth:`RunFold.session_state`)."""
        self.status = status
        new_session = self.new_session(status, self.session_started)
        self.state, self.reason = self.session_state(status, self.session_started)
        if status.get("ended"):
            self.ended_t = status.get("ended")
        elif new_session:
            self.ended_t = None

    def shown_state(self, now: float) -> str:
        """What every console shows, ``stalled`` and ``lost`` included (:func:`shown_state`)."""
        return shown_state(self, self.status, now, self.session_started, self.run_dir)

    # The newest step and start event's figures.
    lr = property(lambda self: self.last_step.get("lr"))
    grad_norm = property(lambda self: self.last_step.get("grad_norm"))
    samples_per_s = property(lambda self: self.last_step.get("samples_per_s"))
    tokens_per_s = property(lambda self: self.last_step.get("tokens_per_s"))
    world_size = property(lambda self: self.start.get("world_size"))
    device_type = property(lambda self: self.start.get("device_type"))
    precision = property(lambda self: self.start.get("precision"))
    task = property(lambda self: self.start.get("task"))
    params = property(lambda self: self.start.get("params"))
    flops_per_sample = property(lambda self: self.start.get("flops_per_sample"))
    started_t = property(lambda self: self.start.get("t"))

    @property
    def done(self) -> bool:
        """Ended, as status.json records it (``lost`` included: a reader recorded it)."""
        return bool(self.status.get("ended")) and (
            self.state in FINAL_STATES or self.state == "lost"
        )

    @property
    def exit_code(self) -> int | None:
        """The run's exit code (:func:`runs.exit_code`, status.json's number); None while it
        is live. ``lost`` (set by a follower whose supervisor vanished) is a failure."""
        if not (self.done or self.state == "lost"):
            return None
        return status_exit_code(self.status, self.state)

    def elapsed_s(self) -> float | None:
        start = self.status.get("started") or self.started_t
        if start is None:
            return None
        return (self.ended_t or time.time()) - start


class RunFollower:
    """Reads a run directory incrementally: new events, and the supervisor's status."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.tail = JsonlTail(self.run_dir / "events.jsonl")
        self.state = RunState()
        self.state.run_dir = self.run_dir
        self.telemetry = TelemetryFold(self.run_dir)
        # A resumed run's earlier sessions: folded into the state, never reported as news.
        meta = read_json(self.run_dir / "meta.json")
        session = current_session(meta) if isinstance(meta, dict) else {}
        start = session.get("events_from")
        self.state.session_started = session.get("started")
        self._history = start if isinstance(start, int) and start > 0 else 0

    def poll(self) -> list[dict[str, Any]]:
        if self._history > self.tail.offset:
            for e in self.tail.read(max_bytes=self._history - self.tail.offset):
                self.state.apply(e)
        self._history = 0
        new = self.tail.read()
        for e in new:
            self.state.apply(e)
            if e.get("kind") == "start":
                self.state.session_began = True
        self.state.apply_status(read_status(self.run_dir))
        if self.telemetry.poll():
            self.state.gpus = self.telemetry.gpus()
        return new

    def supervisor_alive(self) -> bool:
        pid = self.state.status.get("pids", {}).get("supervisor")
        return True if not pid else pid_alive(pid)  # no pid yet: not started yet
