"""RunState: a run's events and status folded into what a console shows (no torch)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The writer defines the file format; it imports no torch, so the console may read it here.
from .engine.heartbeat import DIR as HEARTBEAT_DIR
from .engine.heartbeat import PHASES as PHASE_ORDER
from .events import KINDS, JsonlTail
from .runs import FINAL_STATES, read_status

STALL_MIN_S = 30.0
STALL_FACTOR = 10.0
# A rank's heartbeat thread writes about once a second; this much silence means it is frozen.
HEARTBEAT_SILENT_S = 5.0


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stall_min_s() -> float:
    """Seconds without a step before a running run is ``stalled`` (``$GPU_CONSOLE_STALL_S``)."""
    try:
        return max(0.1, float(os.environ.get("GPU_CONSOLE_STALL_S", STALL_MIN_S)))
    except ValueError:
        return STALL_MIN_S


def stall_limit_s(step_time_s: float | None) -> float:
    """max(30 s, 10× the median step time): a slow step is not a stall."""
    return max(stall_min_s(), STALL_FACTOR * (step_time_s or 0.0))


def derived_state(status: dict[str, Any], now: float, step_time_s: float | None = None) -> str:
    """The state a reader shows: status.json's, or ``lost`` / ``stalled`` (DESIGN.md).

    ``lost``: status says the run is live but its supervisor is gone. ``stalled``: running,
    but no step for max(30 s, 10× the median step time, which the supervisor keeps in
    status.json).
    """
    state = status.get("state", "starting")
    if status.get("ended") or state in FINAL_STATES:
        return state
    if not pid_alive(status.get("pids", {}).get("supervisor")):
        return "lost"
    last = status.get("last_step_t")
    limit = stall_limit_s(step_time_s or status.get("step_time_s"))
    if state == "running" and last and now - last > limit:
        return "stalled"
    return state


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's heartbeat record on this node, by rank (unreadable ones skipped)."""
    beats = []
    folder = Path(run_dir) / HEARTBEAT_DIR
    try:
        paths = sorted(folder.glob("rank-*.json"))
    except OSError:
        return beats
    for path in paths:
        for _ in range(3):  # rewritten in place: a read may catch a write half-way
            try:
                beats.append(json.loads(path.read_bytes().strip() or b"null"))
                break
            except (OSError, ValueError):
                continue
    return [b for b in beats if isinstance(b, dict) and isinstance(b.get("rank"), int)]


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
    live = [b for b in beats if b.get("phase") not in ("done", "failed")]
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
            parts.append(
                f"rank {b['rank']} (step {b.get('step')}, {b.get('phase')}, for {since:.0f} s)"
            )
    return ", ".join(parts)


@dataclass
class RunState:
    state: str = "starting"
    reason: str = ""
    step: int = 0
    start_step: int = 0
    max_steps: int | None = None
    loss: float | None = None
    best_loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    world_size: int | None = None
    device_type: str | None = None
    precision: str | None = None
    task: str | None = None
    params: int | None = None
    started_t: float | None = None
    first_step_t: float | None = None
    first_step: int = 0  # the step of the first step event: the rate is measured from it
    last_step_t: float | None = None
    ended_t: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    peak_memory: dict[int, int] = field(default_factory=dict)
    logs: list[dict[str, Any]] = field(default_factory=list)
    controls: list[dict[str, Any]] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    # MFU (peaks.py): the newest step's, every step's for the mean, and why none is shown.
    mfu: float | None = None
    mfus: list[float] = field(default_factory=list)
    mfu_not_shown: str | None = None
    flops_per_sample: float | None = None

    def apply(self, e: dict[str, Any]) -> None:
        kind = e.get("kind")
        if kind not in KINDS:
            return
        t = e.get("t")
        if kind == "start":
            self.started_t = t
            for k in ("world_size", "device_type", "precision", "task", "params", "max_steps"):
                setattr(self, k, e.get(k))
            self.start_step = self.step = int(e.get("start_step") or 0)
            self.flops_per_sample = e.get("flops_per_sample")
            self.mfu_not_shown = e.get("mfu_not_shown")
        elif kind == "step":
            self.step = int(e.get("step", self.step))
            self.loss = e.get("loss")
            if isinstance(self.loss, (int, float)) and (
                self.best_loss is None or self.loss < self.best_loss
            ):
                self.best_loss = self.loss
            self.lr = e.get("lr")
            self.grad_norm = e.get("grad_norm")
            self.samples_per_s = e.get("samples_per_s")
            self.tokens_per_s = e.get("tokens_per_s")
            self.step_time_s = e.get("step_time_s")
            if self.samples_per_s is not None:
                self.throughput.append(self.samples_per_s)
            self.mfu = e.get("mfu")
            if isinstance(self.mfu, (int, float)):
                self.mfus.append(self.mfu)
            if self.first_step_t is None:
                self.first_step_t, self.first_step = t, self.step
            self.last_step_t = t
            for m in e.get("memory") or []:
                r = m.get("rank")
                self.peak_memory[r] = max(self.peak_memory.get(r, 0), int(m.get("peak") or 0))
        elif kind == "eval":
            self.eval = {k: v for k, v in e.items() if k not in ("v", "t", "kind", "step")}
        elif kind == "checkpoint":
            self.checkpoints.append(e)
        elif kind == "status":
            self.state = e.get("state", self.state)
            self.reason = e.get("reason", "")
        elif kind == "log":
            self.logs.append(e)
        elif kind == "control":
            self.controls.append(e)

    def apply_status(self, status: dict[str, Any]) -> None:
        """The supervisor's word is final once the run has ended."""
        self.status = status
        if status.get("ended"):
            self.state = status.get("state", self.state)
            self.reason = status.get("reason", self.reason)
            self.ended_t = status.get("ended")

    @property
    def done(self) -> bool:
        return bool(self.status.get("ended")) and self.state in FINAL_STATES

    def eta_s(self) -> float | None:
        if not (self.max_steps and self.first_step_t and self.last_step_t):
            return None
        done = self.step - self.first_step
        if done <= 0 or self.last_step_t <= self.first_step_t:
            return None
        per_step = (self.last_step_t - self.first_step_t) / done
        return per_step * (self.max_steps - self.step)

    def mean_samples_per_s(self) -> float | None:
        return sum(self.throughput) / len(self.throughput) if self.throughput else None

    def mean_mfu(self) -> float | None:
        return sum(self.mfus) / len(self.mfus) if self.mfus else None

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

    def poll(self) -> list[dict[str, Any]]:
        new = self.tail.read()
        for e in new:
            self.state.apply(e)
        self.state.apply_status(read_status(self.run_dir))
        return new

    def supervisor_alive(self) -> bool:
        pid = self.state.status.get("pids", {}).get("supervisor")
        return True if not pid else pid_alive(pid)  # no pid yet: not started yet
