"""A run directory folded into what the run screen draws (no Textual, no torch).

:class:`RunFeed` belongs to one worker thread: :meth:`RunFeed.load` reads the run fast at any
size (see :mod:`.reader`), :meth:`RunFeed.poll` picks up what is new (events, status, rank
output, device samples), and :meth:`RunFeed.snapshot` returns an immutable
:class:`RunSnapshot` that the UI thread draws. Nothing here is shared between threads but
snapshots.
"""

from __future__ import annotations

import bisect
import math
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..events import JsonlTail
from ..fold import RunFold, shown_state, with_signs
from ..format import early_stop_line, human_bytes, optimizer_line, strategy_text
from ..heartbeats import pid_alive
from ..lost import ENGINE_ENDS, settle
from ..runs import FINAL_STATES, current_session, list_checkpoints, read_json, read_status
from ..session_lock import is_held
from ..stall import quiet_s
from . import rank_log, reader
from .devices import DeviceFeed, DeviceView
from .series import Point, Series
from .startup import startup_stage

LIVE_STATES = ("starting", "compiling", "running", "paused", "stopping", "stalled", "restarting")
LOG_LINES = 500
CHECKPOINT_ROWS = 50  # the newest checkpoints on disk the panel lists
_META_KEYS = ("v", "t", "kind", "step")


@dataclass(frozen=True)
class LogLine:
    level: str  # "info", "warning", "error", "state", "checkpoint", "command"
    text: str
    t: float | None = None


@dataclass(frozen=True)
class RunSnapshot:
    run_dir: Path
    name: str
    state: str
    reason: str
    step: int
    max_steps: int | None
    loss: float | None
    best_loss: float | None
    lr: float | None
    grad_norm: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    world_size: int | None
    device_type: str | None
    precision: str | None
    task: str | None
    params: int | None
    elapsed_s: float | None
    eta_s: float | None
    now: float
    loss_series: Series  # read-only in the UI: a frozen copy
    eval_points: list[Point]
    eval_name: str
    eval_latest: dict[str, float]
    lr_points: list[Point]
    throughput_points: list[Point]
    tokens_points: list[Point]
    restarts: int
    checkpoints: list[dict[str, Any]]  # on disk, oldest first (runs.list_checkpoints)
    controls: dict[str, dict[str, Any]]
    new_logs: list[LogLine]
    failure: dict[str, Any] | None
    devices: DeviceView
    exit_code: int | None
    sampled: bool  # the first read sampled a big file
    complete: bool  # every rare event of the file is in (a sampled file: once backfilled)
    events_read: int
    live: bool = field(default=False)
    mfu: float | None = None  # the newest step event's (peaks.py)
    mfu_not_shown: str | None = None  # why there is none, from the start event
    # The task's train-time metrics (step events' ``metrics``): frozen series by name.
    metric_series: dict[str, Series] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)  # the newest of each
    eval_progress: dict[str, Any] | None = None  # the eval in progress: step, done, total
    compiling_since: float | None = None  # train.compile: when the first step's compile began
    strategy: str | None = None  # "fsdp (2 blocks + root)"; None under DDP (format.py)
    skipped: int | None = None  # updates skipped for a non-finite gradient (nan_policy skip)
    startup: str = ""  # before the session's first step: what it is doing (startup.py)
    keep_best: str = ""  # checkpoint.keep_best: the eval metric the best checkpoint is kept by

    @property
    def ended(self) -> bool:
        return self.state in FINAL_STATES


class RunModel(RunFold):
    """THE fold (:mod:`..fold`) and what only the run screen shows (series for the charts,
    log lines, every eval): :meth:`apply` in file order, :meth:`backfill` for older events."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_series = Series()
        self.lr_series = Series(512, 512)
        self.throughput_series = Series(512, 512)
        self.tokens_series = Series(512, 512)  # tokens/s, where the task reports tokens
        self.metric_series: dict[str, Series] = {}  # the task's train metrics, by name
        self.evals: list[tuple[int, dict[str, float]]] = []  # sorted by step
        self.controls: dict[str, dict[str, Any]] = {}
        self.logs: deque[LogLine] = deque(maxlen=LOG_LINES)
        self.log_count = 0  # lines ever appended to ``logs``
        # The newest of the engine's marks of a session's start-up, in file order (startup.py):
        # "building" (its first status), "started" (the start event), "stepped" (a step).
        self.startup_mark = ""

    def _log(self, line: LogLine) -> None:
        self.logs.append(line)
        self.log_count += 1

    def apply(self, e: dict[str, Any]) -> None:
        super().apply(e)
        kind = e.get("kind")
        if kind == "step":
            if self.last_step is e:  # the fold took it (its step is a number)
                self.startup_mark = "stepped"
                step = e["step"]
                self.loss_series.append(step, e.get("loss"))
                self.lr_series.append(step, e.get("lr"))
                self.throughput_series.append(step, e.get("samples_per_s"))
                self.tokens_series.append(step, e.get("tokens_per_s"))
                metrics = e.get("metrics")
                for name, value in metrics.items() if isinstance(metrics, dict) else ():
                    self.metric_series.setdefault(name, Series(1024, 1024)).append(step, value)
        elif kind == "start" and self.start is e:  # what was built, as the headless run says
            self.startup_mark = "started"
            for o in e.get("optimizers") or []:
                self._log(LogLine("info", optimizer_line(o), e.get("t")))
        elif kind == "status":
            if e.get("state") == "starting":
                self.startup_mark = "building"
            text = f"state: {self.state}" + (f" ({self.reason})" if self.reason else "")
            self._log(LogLine("state", text, e.get("t")))
        elif kind == "eval":
            self._add_eval(e)
        elif kind == "early_stop":  # evals since the best, of the patience
            level = "warning" if e.get("stop") else "info"
            self._log(LogLine(level, early_stop_line(e), e.get("t")))
        elif kind == "checkpoint":
            size = e.get("bytes")
            size_text = f", {human_bytes(size)}" if isinstance(size, (int, float)) else ""
            self._log(
                LogLine("checkpoint", f"checkpoint @ step {e.get('step')} ({e.get('reason')}"
                        f"{size_text})", e.get("t"))
            )  # fmt: skip
        elif kind == "control":
            self._add_control(e)
        elif kind == "log":
            level = str(e.get("level") or "info")
            self._log(LogLine(level, f"[{level}] {e.get('message', '')}", e.get("t")))

    def backfill(self, e: dict[str, Any]) -> None:
        """An event from before everything applied so far (found by the background scan)."""
        kind = e.get("kind")
        if kind == "eval":
            self._add_eval(e)
        elif kind == "control":
            self._add_control(e, older=True)
        elif kind == "start" and not self.start:
            mark = self.startup_mark
            self.apply(e)
            self.startup_mark = mark  # older than every event applied

    def _add_eval(self, e: dict[str, Any]) -> None:
        metrics = {
            k: v
            for k, v in e.items()
            if k not in _META_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        step = e.get("step") if isinstance(e.get("step"), int) else self.step
        keys = [s for s, _ in self.evals]
        i = bisect.bisect_right(keys, step)
        if i and keys[i - 1] == step:
            self.evals[i - 1] = (step, metrics)
        else:
            self.evals.insert(i, (step, metrics))

    def _add_control(self, e: dict[str, Any], older: bool = False) -> None:
        cid = e.get("id")
        if not isinstance(cid, str):
            return
        if older and cid in self.controls:
            return
        self.controls[cid] = e

    def eval_series(self) -> tuple[str, list[Point]]:
        """The eval metric drawn beside the train loss: ``loss`` if reported, else the first."""
        if not self.evals:
            return "", []
        names = list(self.evals[-1][1])
        # Several splits (``val/loss``, ``train_est/loss``): the first split's loss.
        split_loss = next((n for n in names if n.endswith("/loss")), None)
        name = "loss" if "loss" in names else (split_loss or (names[0] if names else ""))
        pts = [(s, m[name]) for s, m in self.evals if name in m]
        if len(pts) > 1024:
            stride = math.ceil(len(pts) / 1024)
            pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
        return name, pts


class RunFeed:
    def __init__(
        self,
        run_dir: Path,
        *,
        owner: bool = False,  # launched here; the supervisor records telemetry either way
        supervisor: subprocess.Popen | None = None,
        clock: Callable[[], float] = time.time,
        sample_interval_s: float = 1.0,
        telemetry: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.events_path = self.run_dir / "events.jsonl"
        self.model = RunModel()
        self.clock = clock
        self.supervisor = supervisor
        self.status: dict[str, Any] = {}
        self._status_mtime: float | None = None
        self._settled_for: tuple[float | None, int] | None = None  # what _settle last tried
        self._tail = JsonlTail(self.events_path)
        self._gap: tuple[int, int] | None = None
        self._log_offset: int | None = None
        self._echoes = rank_log.Echoes()  # log events whose echo in the ranks' output is due
        self._held: list[tuple[str, str]] = []  # rank 0's echo-like lines kept back a read
        self._profiler_said = False
        self._new_logs: list[LogLine] = []
        self._log_mark = 0
        self.devices = DeviceFeed(self.run_dir, interval_s=sample_interval_s, enabled=telemetry)
        self.meta = read_json(self.run_dir / "meta.json") or {}
        self.keep_best = _keep_best(self.run_dir)
        self.sampled = False
        # What checkpoints/ holds (pruning removes what events once announced), read again
        # when the directory changes or a checkpoint event says a write (and prune) is done.
        self.checkpoints: list[dict[str, Any]] = []
        self._checkpoints_seen: int | None = None

    # -- reading ---------------------------------------------------------------------------
    def load(self) -> None:
        """The first read: fast whatever the size of events.jsonl."""
        quick = reader.quick_events(self.events_path)
        for _, e in quick.events:
            self.model.apply(e)
        self._tail.offset = quick.end
        self._gap = quick.gap
        self.sampled = quick.sampled
        self._read_status()
        self._settle()
        self._take_model_logs()  # before the ranks' output: it holds their events' echoes
        self._read_logs()
        self._read_checkpoints(True)
        self.devices.update(self.live, self.model.last_step)

    def backfill(self) -> bool:
        """Find the rare events of a big file's sampled middle; True if there was one."""
        if self._gap is None:
            return False
        for _, e in reader.backfill_events(self.events_path, self._gap):
            self.model.backfill(e)
        self._gap = None
        return True

    def poll(self) -> bool:
        """Read what is new; True if anything the screen shows may have changed."""
        if self.supervisor is not None:
            self.supervisor.poll()  # reap our child, so no zombie piles up
        changed = written = False
        for e in self._tail.read():
            self.model.apply(e)
            changed = True
            written |= e.get("kind") == "checkpoint"
        changed |= self._read_checkpoints(written)
        changed |= self._read_status()
        changed |= self._settle()
        self._take_model_logs()  # before the ranks' output: it holds their events' echoes
        changed |= self._read_logs()
        changed |= self.devices.update(self.live, self.model.last_step)
        return changed or bool(self._new_logs)

    def _settle(self) -> bool:
        """status.json as ``ls`` and ``status`` settle it (:func:`lost.settle`), so every view
        agrees: a run whose supervisor is gone without recording an end is recorded ``lost``;
        a damaged or missing status.json whose events hold the engine's end is repaired
        (where the run directory cannot be written, that end is derived and shown). Tried
        once per version of status.json and of the events; True if the status changed."""
        if self.status.get("ended"):
            return False
        if self.status:
            if not self._supervisor_gone():
                return False
        elif self.model.state not in ENGINE_ENDS or is_held(self.run_dir):
            return False  # no end to repair, or a session holds the run (a resume starting)
        key = (self._status_mtime, self.model.events)
        if key == self._settled_for:
            return False
        self._settled_for = key
        settled = settle(self.run_dir)
        self._read_status()
        if settled.get("ended") and not self.status.get("ended"):
            self.status = settled  # nothing could be written there: the derived end
        return True

    def _supervisor_gone(self) -> bool:
        """status.json says the run is live, but its supervisor is not (it was killed)."""
        if not self.status or self.status.get("ended"):
            return False
        pids = self.status.get("pids")
        return not pid_alive(pids.get("supervisor") if isinstance(pids, dict) else None)

    def _read_status(self) -> bool:
        try:
            mtime = (self.run_dir / "status.json").stat().st_mtime
        except FileNotFoundError:
            if self._status_mtime is None:
                return False
            # A resume removes the ended session's status until its new supervisor writes one.
            self._status_mtime, self.status = None, {}
            self.meta = read_json(self.run_dir / "meta.json") or self.meta
            return True
        if mtime == self._status_mtime:
            return False
        self._status_mtime = mtime
        started = self.status.get("started")
        self.status = read_status(self.run_dir)
        if self.status.get("started") != started:  # a new session: it may run elsewhere
            self.meta = read_json(self.run_dir / "meta.json") or self.meta
        return True

    def _read_checkpoints(self, written: bool) -> bool:
        """List checkpoints/ again if it changed (its mtime) or a checkpoint was written."""
        try:
            seen = (self.run_dir / "checkpoints").stat().st_mtime_ns
        except OSError:
            seen = None
        if not written and seen == self._checkpoints_seen:
            return False
        self._checkpoints_seen = seen
        found = list_checkpoints(self.run_dir, newest=CHECKPOINT_ROWS)
        changed, self.checkpoints = found != self.checkpoints, found
        return changed

    def _read_logs(self) -> bool:
        lines, self._log_offset = reader.tail_text(
            self.run_dir / "logs" / "torchrun.log", self._log_offset
        )
        # An echo-like line of the last read whose event had not been read then: it may be now.
        held, self._held = self._held, []
        for text, bare in held:
            if not self._echoes.is_echo(bare):
                self._new_logs.append(LogLine(rank_log.level_of(text), text))
        for line in lines:
            text = rank_log.shown_as(line)
            if not text.strip():
                continue
            bare = rank_log.echo_candidate(text)
            if bare is not None:
                if not self._echoes.is_echo(bare):  # its event may be written after our read
                    self._held.append((text, bare))
                continue
            if rank_log.profiler_noise(text):
                if not self._profiler_said:
                    self._profiler_said = True
                    self._new_logs.append(LogLine("info", rank_log.PROFILER_FOLDED))
                continue
            self._new_logs.append(LogLine(rank_log.level_of(text), text))
        return bool(lines) or bool(held)

    def _take_model_logs(self) -> None:
        logs = self.model.logs
        # Only lines appended since the last take (the deque may have dropped old ones).
        n = min(len(logs), self.model.log_count - self._log_mark)
        fresh = list(logs)[len(logs) - n :] if n > 0 else []
        self._log_mark = self.model.log_count
        for line in fresh:
            if line.text.startswith(f"[{line.level}] "):  # a log event: the ranks echo it
                self._echoes.shown(line.text)
        self._new_logs.extend(fresh)

    def close(self) -> None:
        self.devices.close()

    # -- what is shown ---------------------------------------------------------------------
    @property
    def session(self) -> dict[str, Any]:
        """meta.json as the current session sees it (a resume may run on other devices)."""
        return current_session(self.meta)

    def _new_session(self) -> bool:
        """A resumed run whose new engine has not spoken yet (:meth:`RunFold.new_session`)."""
        return self.model.new_session(self.status, self.session.get("started"))

    @property
    def state(self) -> str:
        sup = self.supervisor
        if not self.status and sup is not None and sup.returncode is not None:
            return "lost"  # the supervisor this console started died before writing a status
        started = self.session.get("started")
        return shown_state(self.model, self.status, self.clock(), started, self.run_dir)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def _stalled_because(self, now: float) -> str:
        quiet = quiet_s(with_signs(self.model, self.status), now, self.run_dir)
        why = f"no step for {quiet:.0f} s" if quiet is not None else "no sign of life"
        stopped = _stalled_ranks(self.run_dir, now)
        return f"{why}; stopped: {stopped}" if stopped else why

    def snapshot(self) -> RunSnapshot:
        m, st = self.model, self.status
        now = self.clock()
        state = self.state
        started = st.get("started") or m.start.get("t")
        ended = st.get("ended")
        eval_name, eval_points = m.eval_series()
        logs, self._new_logs = self._new_logs, []
        last = m.last_step
        new_session = self._new_session()
        _, reason = m.session_state(st, self.session.get("started"))
        # Before a resumed session's engine speaks, its devices are the session's placement.
        device_type = None if new_session else m.start.get("device_type")
        if state == "stalled":
            reason = self._stalled_because(now) or reason
        return RunSnapshot(
            run_dir=self.run_dir,
            name=self.run_dir.name,
            state=state,
            reason=reason,
            step=m.step or (st.get("step") or 0),
            max_steps=m.max_steps if m.max_steps is not None else st.get("max_steps"),
            loss=last.get("loss", st.get("loss")),
            best_loss=m.best_loss,
            lr=last.get("lr"),
            grad_norm=last.get("grad_norm"),
            samples_per_s=last.get("samples_per_s"),
            tokens_per_s=last.get("tokens_per_s"),
            world_size=m.start.get("world_size") or st.get("world_size"),
            device_type=device_type or (self.session.get("placement") or {}).get("device_type"),
            precision=m.start.get("precision"),
            strategy=strategy_text(m.start) if m.start.get("strategy") == "fsdp" else None,
            task=m.start.get("task"),
            params=m.start.get("params"),
            elapsed_s=((ended or now) - started) if started else None,
            eta_s=None if state in FINAL_STATES else m.eta_s(),
            now=now,
            loss_series=_frozen(m.loss_series),
            eval_points=eval_points,
            eval_name=eval_name,
            eval_latest=dict(m.evals[-1][1]) if m.evals else {},
            lr_points=m.lr_series.view(),
            throughput_points=m.throughput_series.view(),
            tokens_points=m.tokens_series.view(),
            restarts=m.restarts if m.start else int(st.get("restarts") or 0),
            checkpoints=list(self.checkpoints),
            controls=dict(m.controls),
            new_logs=logs,
            failure=st.get("failure"),
            devices=self.devices.view(device_type, last, self.session),
            exit_code=st.get("exit_code"),
            sampled=self.sampled,
            complete=self._gap is None,
            events_read=m.events,
            live=state in LIVE_STATES,
            mfu=m.mfu,
            eval_progress=m.eval_progress if state in LIVE_STATES else None,
            mfu_not_shown=m.mfu_not_shown,
            metric_series={k: _frozen(v) for k, v in sorted(m.metric_series.items())},
            train_metrics=dict(m.train_metrics),
            compiling_since=m.compiling_since if state == "compiling" else None,
            skipped=_skipped(m.skipped, st.get("skipped_updates")),
            startup=startup_stage(
                self.run_dir,
                state=state,
                status=st,
                session=self.session,
                mark="" if new_session else m.startup_mark,
            ),
            keep_best=self.keep_best,
        )


def _skipped(folded: int | None, recorded: Any) -> int | None:
    """The fold's count, or status.json's where that is higher: a big file's first read
    samples its step events, while the supervisor folded every one."""
    if type(recorded) is not int:
        return folded
    return recorded if folded is None else max(folded, recorded)


def _stalled_ranks(run_dir: Path, now: float) -> str:
    """Which ranks stopped, from their heartbeats (an engine without them: nothing)."""
    try:
        from ..state import describe_stopped, read_heartbeats
    except ImportError:
        return ""
    return describe_stopped(read_heartbeats(run_dir), now)


def _frozen(s: Series) -> Series:
    copy = Series(s.capacity, s.recent.maxlen or 2048)
    copy.points = list(s.points)
    copy.recent = deque(s.recent, maxlen=s.recent.maxlen)
    copy.stride, copy._sum, copy._n, copy.count = s.stride, s._sum, s._n, s.count
    return copy


def _keep_best(run_dir: Path) -> str:
    """run.toml's ``checkpoint.keep_best`` (``""``: none, or run.toml unreadable)."""
    from ..toml_text import loads

    try:
        doc = loads((run_dir / "run.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return ""
    section = doc.get("checkpoint")
    value = section.get("keep_best") if isinstance(section, dict) else None
    return value if isinstance(value, str) else ""
