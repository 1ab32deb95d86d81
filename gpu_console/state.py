"""RunState: a run's events, status and telemetry folded into what a console shows (no torch)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import strict_json

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
from .heartbeats import PHASES as PHASE_ORDER
from .heartbeats import read_heartbeats  # noqa: F401 - the readers' import of it
from .runs import FINAL_STATES, current_session, read_json, read_status, status_exit_code

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


# -- telemetry: what each GPU of the run did ------------------------------------------------

TELEMETRY_FILE = "telemetry.jsonl"


@dataclass
class GpuFigures:
    """One GPU over a run: folded sample by sample, or merged from a recorded summary.

    Means and integrals are over time (trapezoids between samples), so samples written at a
    longer interval later in a run weigh as much as the time they cover.
    """

    uuid: str | None
    index: int | None = None
    name: str | None = None
    memory_total: int | None = None
    samples: int = 0
    first_t: float | None = None
    last_t: float | None = None
    util_s: float = 0.0  # ∫ util dt (percent · s)
    util_span_s: float = 0.0
    util_last: float | None = None
    memory_peak: int | None = None
    temperature_max: int | None = None
    counter_j: float = 0.0  # from NVML's total-energy counter
    counter_span_s: float = 0.0
    power_j: float = 0.0  # ∫ power dt
    power_span_s: float = 0.0
    _last: dict[str, Any] = field(default_factory=dict, repr=False)

    def add(self, t: float, g: dict[str, Any]) -> None:
        if g.get("lost"):
            return
        self.index = g.get("index", self.index)
        self.name = g.get("name") or self.name
        self.memory_total = g.get("memory_total") or self.memory_total
        self.samples += 1
        self.first_t = t if self.first_t is None else self.first_t
        prev = self._last
        dt = t - prev["t"] if prev else 0.0
        util, power, energy = _num(g.get("util_gpu")), _num(g.get("power_w")), g.get("energy_mj")
        if dt > 0 and util is not None and prev.get("util") is not None:
            self.util_s += (util + prev["util"]) / 2 * dt
            self.util_span_s += dt
        if dt > 0 and power is not None and prev.get("power") is not None:
            self.power_j += (power + prev["power"]) / 2 * dt
            self.power_span_s += dt
        before = prev.get("energy")
        # A smaller reading than the last: the driver reloaded and the counter restarted.
        if dt > 0 and isinstance(energy, int) and isinstance(before, int) and energy >= before:
            self.counter_j += (energy - before) / 1000
            self.counter_span_s += dt
        self.util_last = util if util is not None else self.util_last
        self.memory_peak = _max(self.memory_peak, g.get("memory_used"))
        self.temperature_max = _max(self.temperature_max, g.get("temperature_c"))
        self.last_t = t
        self._last = {"t": t, "util": util, "power": power, "energy": energy}

    def merge(self, other: GpuFigures) -> GpuFigures:
        """Figures over both stretches (a run continued by another supervisor)."""
        out = GpuFigures(self.uuid)
        for f in ("util_s", "util_span_s", "counter_j", "counter_span_s", "power_j"):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        out.power_span_s = self.power_span_s + other.power_span_s
        out.samples = self.samples + other.samples
        later = other if (other.last_t or 0) >= (self.last_t or 0) else self
        out.index, out.name = later.index, later.name
        out.memory_total = later.memory_total or self.memory_total or other.memory_total
        out.first_t = min((t for t in (self.first_t, other.first_t) if t is not None), default=None)
        out.last_t = max((t for t in (self.last_t, other.last_t) if t is not None), default=None)
        out.util_last = later.util_last
        out.memory_peak = _max(self.memory_peak, other.memory_peak)
        out.temperature_max = _max(self.temperature_max, other.temperature_max)
        out._last = later._last
        return out

    @property
    def util_mean(self) -> float | None:
        if self.util_span_s > 0:
            return self.util_s / self.util_span_s
        return self.util_last  # one sample: its reading

    @property
    def energy(self) -> tuple[float | None, str | None]:
        """(Wh, source): NVML's energy counter where the GPU has one, else integrated power."""
        if self.counter_span_s > 0:
            return self.counter_j / 3600, "counter"
        if self.power_span_s > 0:
            return self.power_j / 3600, "power"
        return None, None

    def to_json(self) -> dict[str, Any]:
        wh, source = self.energy
        mean = self.util_mean
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "util_mean": None if mean is None else round(mean, 2),
            "memory_peak": self.memory_peak,
            "memory_total": self.memory_total,
            "temperature_max": self.temperature_max,
            "energy_wh": None if wh is None else round(wh, 4),
            "energy_source": source,
            "samples": self.samples,
            "span_s": round((self.last_t or 0) - (self.first_t or 0), 3),
            "first_t": self.first_t,
            "last_t": self.last_t,
            # What a later merge needs (a summary line is folded as if its samples were read).
            "fold": {
                "util_s": self.util_s,
                "util_span_s": self.util_span_s,
                "counter_j": self.counter_j,
                "counter_span_s": self.counter_span_s,
                "power_j": self.power_j,
                "power_span_s": self.power_span_s,
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuFigures:
        g = cls(d.get("uuid"), d.get("index"), d.get("name"), d.get("memory_total"))
        g.samples = int(d.get("samples") or 0)
        g.first_t, g.last_t = d.get("first_t"), d.get("last_t")
        g.util_last = d.get("util_mean")
        g.memory_peak, g.temperature_max = d.get("memory_peak"), d.get("temperature_max")
        for k, v in (d.get("fold") or {}).items():
            if k in cls.__dataclass_fields__ and isinstance(v, (int, float)):
                setattr(g, k, float(v))
        return g


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _max(a: Any, b: Any) -> Any:
    if not isinstance(b, (int, float)) or isinstance(b, bool):
        return a
    return b if a is None or b > a else a


class TelemetryFold:
    """``telemetry.jsonl`` folded into per-GPU figures, read incrementally like events.

    ``sample`` lines are folded one by one. A ``summary`` line is the recorder's own fold of
    everything before it, including the samples it took but did not write (the file thins
    out over a long run): it replaces what the lines before it gave, so an ended run's
    figures are exact. Samples after it (a run continued in the same directory) add on.

    A run on several nodes has a run directory, and a recorder, per node; ``nodes.json``
    (written by each node's first rank) names them all. With ``nodes`` (every reader but the
    recorder, which folds its own file only), the other nodes' files are folded too, where
    this machine can read them (a shared file system), and every GPU says its ``host`` and
    ``node``. Another node's directory counts only if its ``nodes.json`` is this one's: a
    same-named directory on an unshared disk is not the run's.
    """

    def __init__(self, run_dir: Path | None = None, nodes: bool = True):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tail = JsonlTail(self.run_dir / TELEMETRY_FILE) if self.run_dir is not None else None
        self.done: dict[str, GpuFigures] = {}  # from summary lines
        self.current: dict[str, GpuFigures] = {}  # samples since the last summary
        self.nvml: dict[str, Any] = {}
        self.samples = 0
        self.follow_nodes = nodes and self.run_dir is not None
        self.place: dict[str, Any] = {}  # this directory's node and host
        self.others: list[tuple[dict[str, Any], TelemetryFold]] = []
        self._nodes_seen: list[dict[str, Any]] | None = None
        self._launch_host: tuple[str | None] | None = None

    def skip_to_summary(self) -> bool:
        """Where the file ends with a summary line (an ended run), take it and skip the
        samples before it: no need to parse a long run's file to show its figures."""
        self._find_nodes()
        for _, other in self.others:
            other.skip_to_summary()
        if self.tail is None or self.tail.offset:
            return False
        try:
            with open(self.tail.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 2**16))
                data = f.read()
            end = strict_json.loads(data[: data.rfind(b"\n")].rpartition(b"\n")[2])
        except (OSError, ValueError):
            return False
        if not (isinstance(end, dict) and end.get("kind") == "summary"):
            return False
        self.apply(end)
        self.tail.offset = size - len(data) + data.rfind(b"\n") + 1
        return True

    def poll(self) -> bool:
        """Fold what is new in the file (and the other nodes'); True if anything was."""
        got = self._find_nodes()
        lines = self.tail.read() if self.tail is not None else []
        for line in lines:
            self.apply(line)
        for _, other in self.others:
            got |= other.poll()
        return bool(lines) or got

    def _find_nodes(self) -> bool:
        """Read nodes.json (once it is written, and again if a new session rewrote it)."""
        if not self.follow_nodes:
            return False
        from .runs import read_nodes

        try:
            nodes = read_nodes(self.run_dir)
        except OSError:
            return False
        if not nodes or nodes == self._nodes_seen:
            return False
        self._nodes_seen = nodes
        here = str(self.run_dir.resolve())
        self.place = next((n for n in nodes if n["run_dir"] == here), {})
        self.others = []
        for n in nodes:
            if n["run_dir"] == here:
                continue
            try:
                theirs = read_nodes(Path(n["run_dir"]))
            except OSError:
                continue
            if theirs == nodes:  # the same run, seen through a shared file system
                self.others.append((n, TelemetryFold(Path(n["run_dir"]), nodes=False)))
        return True

    def apply(self, line: dict[str, Any]) -> None:
        kind = line.get("kind")
        if kind == "sample":
            self.add(line)
        elif kind == "summary":
            self.done = {_gpu_key(d): GpuFigures.from_json(d) for d in line.get("gpus") or ()}
            self.current = {}

    def add(self, sample: dict[str, Any]) -> None:
        t = sample.get("t")
        if not isinstance(t, (int, float)):
            return
        self.samples += 1
        self.nvml = sample.get("nvml") or self.nvml
        for g in sample.get("gpus") or ():
            key = _gpu_key(g)
            fig = self.current.get(key)
            if fig is None:
                fig = self.current[key] = GpuFigures(g.get("uuid"))
            fig.add(float(t), g)

    def figures(self) -> list[GpuFigures]:
        """This file's GPUs (not the other nodes')."""
        out = dict(self.done)
        for key, g in self.current.items():
            out[key] = out[key].merge(g) if key in out else g
        return sorted(
            (g for g in out.values() if g.samples),
            key=lambda g: (g.index is None, g.index or 0, g.uuid or ""),
        )

    def gpus(self) -> list[dict[str, Any]]:
        """Per GPU of the run, as ``ls --json`` and summaries show it ([] without GPUs); on
        several nodes every node's GPUs (that this machine can read), each with its ``host``
        and ``node``, ordered by node."""
        if not self.follow_nodes:
            return [g.to_json() for g in self.figures()]
        here = self.place or {"node": 0, "host": self._host()}
        out = [self._marked(g, here) for g in self.figures()]
        for node, other in self.others:
            out += [self._marked(g, node) for g in other.figures()]
        return sorted(out, key=lambda g: g["node"] if isinstance(g["node"], int) else 0)

    @staticmethod
    def _marked(g: GpuFigures, node: dict[str, Any]) -> dict[str, Any]:
        return {**g.to_json(), "host": node.get("host"), "node": node.get("node")}

    def _host(self) -> str | None:
        """A single machine's host: where the run was launched (meta.json), read once."""
        if self._launch_host is None:
            meta = read_json(self.run_dir / "meta.json") if self.run_dir is not None else None
            host = current_session(meta).get("host") if isinstance(meta, dict) else None
            self._launch_host = (host if isinstance(host, str) else None,)
        return self._launch_host[0]


def _gpu_key(g: dict[str, Any]) -> str:
    return str(g.get("uuid") or f"index {g.get('index')}")


def gpu_figures(run_dir: Path) -> list[dict[str, Any]]:
    """A run's per-GPU figures, read once (``ls``): from the summary line that ends the file
    when there is one (an ended run: no need to parse the samples), else by folding it all."""
    fold = TelemetryFold(run_dir)
    if not fold.skip_to_summary():
        fold.poll()
    return fold.gpus()
