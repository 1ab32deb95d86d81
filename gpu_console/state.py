"""RunState: a run's events and status folded into what a console shows (no torch)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .events import KINDS, JsonlTail
from .runs import FINAL_STATES, read_status

STALL_MIN_S = 30.0
STALL_FACTOR = 10.0


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


def derived_state(status: dict[str, Any], now: float, step_time_s: float | None = None) -> str:
    """The state a reader shows: status.json's, or ``lost`` / ``stalled`` (DESIGN.md).

    ``lost``: status says the run is live but its supervisor is gone. ``stalled``: running,
    but no step for max(30 s, 10× the step time).
    """
    state = status.get("state", "starting")
    if status.get("ended") or state in FINAL_STATES:
        return state
    if not pid_alive(status.get("pids", {}).get("supervisor")):
        return "lost"
    last = status.get("last_step_t")
    if state == "running" and last:
        limit = max(STALL_MIN_S, STALL_FACTOR * (step_time_s or 0.0))
        if now - last > limit:
            return "stalled"
    return state


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
