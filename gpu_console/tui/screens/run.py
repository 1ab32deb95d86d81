"""The run screen: header, loss / throughput / lr charts, device cards, checkpoints, log,
and on failure the failing rank's traceback. Keys send commands through control.jsonl.

A thread worker owns the :class:`~gpu_console.tui.feed.RunFeed` and posts a snapshot when
something changed, at most every ``refresh_s`` (0.2 s: redraws stay under ~10 Hz however
fast the run logs), and once a second otherwise so clocks tick. Chart lines redraw at most
every :data:`CHART_EVERY_S` (their titles' numbers with every snapshot, as the header's);
text panels only when their text changed.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, RichLog
from textual.worker import get_current_worker

from ...events import append_control
from ...session_lock import is_held
from ..feed import RunFeed, RunSnapshot
from ..messages import ControlSent, Notice, RunUpdated
from ..widgets.chart import BrailleChart, Line
from ..widgets.checkpoints import LEGEND as CHECKPOINTS_LEGEND
from ..widgets.checkpoints import TITLE as CHECKPOINTS_TITLE
from ..widgets.checkpoints import CheckpointList, newest_line
from ..widgets.devices import DevicePanel
from ..widgets.experts import ExpertPanel, even_share_text, expert_loads
from ..widgets.failure import FailurePanel
from ..widgets.header import RunHeader
from ..widgets.text import num
from .modals import ConfirmScreen

WINDOWS: tuple[int | None, ...] = (None, 10_000, 1_000, 100)
TRAIN, EVAL, LR, RATE = "#5fafff", "#ffaf00", "#af87ff", "#5fd787"
LOG_STYLE = {
    "error": "bold #ff5f5f",
    "warning": "#ffd75f",
    "state": "#5fd7ff",
    "checkpoint": "#87afff",
    "command": "bold #5fd787",
    "info": "",
}
CONTROL_ACTIONS = ("checkpoint", "pause", "stop", "kill", "profile")
# ``t``: the steps a profile capture traces (``gpu-console profile --steps`` chooses others).
PROFILE_STEPS = 5
# Charts are the costliest redraw: at most twice a second (numbers in the header: 5 Hz).
CHART_EVERY_S = 0.5


def exit_code_of(s: RunSnapshot | None, status_checkpointed: bool | None = None) -> int:
    """The console's exit code for a run: the run's own (:func:`runs.exit_code`: 0 finished
    or stopped with its checkpoint, 130 interrupted, 137 killed, 1 failed or lost); 0 while
    it is still live."""
    from ...runs import EXIT_FAILED, exit_code

    if s is None or s.live:
        return 0
    code = exit_code(s.state, bool(status_checkpointed))
    return EXIT_FAILED if code is None else code


class RunScreen(Screen):
    # The panels beside the log give way below these widths (app.tcss): the log keeps 40
    # columns at 80.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-medium"), (120, "-wide")]
    BINDINGS = [
        Binding("c", "checkpoint", "ckpt"),
        Binding("p", "pause", "pause"),
        Binding("s", "stop", "stop"),
        Binding("k", "kill", "kill"),
        Binding("t", "profile", "trace"),
        Binding("o", "report", "report"),  # gpu-console report of the run, into RUN/report/
        Binding("d", "detach", "detach"),
        Binding("w", "window", "window"),
        Binding("m", "series", "chart"),  # the main chart: loss, then each task metric
    ]

    def __init__(
        self,
        run_dir: Path,
        *,
        owner: bool = False,
        supervisor: subprocess.Popen | None = None,
        readonly: bool = False,
        clock: Callable[[], float] = time.time,
        refresh_s: float = 0.2,
        sample_interval_s: float = 1.0,
        telemetry: bool = True,
    ) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.owner = owner
        self.supervisor = supervisor
        self.readonly = readonly
        self.clock = clock
        self.refresh_s = refresh_s
        self.sample_interval_s = sample_interval_s
        self.telemetry = telemetry
        self.snapshot: RunSnapshot | None = None
        self.window = 0
        self.series = "loss"  # what the main chart draws: the loss or a task's train metric
        self.pending: dict[str, dict[str, Any]] = {}  # control id → {cmd, state, step}
        self.last_command: Text | None = None
        self._stop = threading.Event()
        self._was_live: bool | None = None
        self.updates = 0  # snapshots drawn (tests and benchmarks wait on it)
        self._plotted = -math.inf  # the first snapshot is plotted, whatever the clock's origin

    # -- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Horizontal(id="charts"):
            yield BrailleChart(id="loss", empty="waiting for the first step…")
            with Vertical(id="side"):
                yield BrailleChart(id="throughput", empty="no throughput yet")
                yield BrailleChart(id="lr", empty="no learning rate yet")
        with VerticalScroll(id="devices-box"):
            yield DevicePanel(id="devices")
        with Horizontal(id="bottom"):
            with VerticalScroll(id="checkpoints-box"):
                yield CheckpointList(id="checkpoints")
            with VerticalScroll(id="experts-box"):
                yield ExpertPanel(id="experts")
            yield RichLog(id="log", max_lines=500, wrap=False, markup=False, highlight=False)
        with VerticalScroll(id="failure-box"):
            yield FailurePanel(id="failure")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#loss").border_title = "loss"
        self.query_one("#throughput").border_title = "samples/s"
        self.query_one("#lr").border_title = "lr"
        self.query_one("#devices-box").border_title = "devices"
        self.query_one("#checkpoints-box").border_title = CHECKPOINTS_TITLE
        self.query_one("#checkpoints-box").border_subtitle = CHECKPOINTS_LEGEND
        self.query_one("#experts-box").border_title = "experts · % of tokens"
        self.query_one("#log").border_title = "log"
        self.query_one("#failure-box").border_title = "failure"
        self.query_one("#header", RunHeader).update(Text(f"{self.run_dir.name}  loading…"))
        self.follow()

    def on_unmount(self) -> None:
        self._stop.set()

    def on_resize(self) -> None:
        # The panels' columns (and the experts' rows) follow their new size once laid out.
        if self.snapshot is not None:
            self.call_after_refresh(self._refit, self.snapshot)

    def _refit(self, s: RunSnapshot) -> None:
        self.query_one("#checkpoints", CheckpointList).show(s.checkpoints, s.now)
        routed = bool(expert_loads(s.train_metrics))
        if routed:
            self.query_one("#experts", ExpertPanel).show(s.train_metrics)
        self._newest_checkpoint(s, routed)

    def _newest_checkpoint(self, s: RunSnapshot, routed: bool) -> None:
        """Where the checkpoints panel gave way (app.tcss), the log's subtitle names the
        newest checkpoint."""
        hidden = self.has_class("-narrow") and routed
        log = self.query_one("#log", RichLog)
        log.border_subtitle = newest_line(s.checkpoints, s.now) if hidden else ""

    # -- the feed (a thread) -----------------------------------------------------------------
    @work(thread=True, exclusive=True, group="feed", name="run feed", exit_on_error=False)
    def follow(self) -> None:
        worker = get_current_worker()
        feed = RunFeed(
            self.run_dir,
            owner=self.owner and not self.readonly,
            supervisor=self.supervisor,
            clock=self.clock,
            sample_interval_s=self.sample_interval_s,
            telemetry=self.telemetry,
        )
        try:
            self._guarded(feed.load)
            self.post_message(RunUpdated(feed.snapshot()))
            if self._guarded(feed.backfill):
                self.post_message(RunUpdated(feed.snapshot()))
            last_post = time.monotonic()
            while not (worker.is_cancelled or self._stop.is_set()):
                live = feed.live
                self._stop.wait(self.refresh_s if live else 1.0)
                changed = self._guarded(feed.poll)
                now = time.monotonic()
                if changed or now - last_post >= (1.0 if live else 5.0):
                    self.post_message(RunUpdated(feed.snapshot()))
                    last_post = now
        finally:
            feed.close()

    def _guarded(self, read: Callable[[], Any]) -> Any:
        """A read that fails (a file vanished, a permission changed) is said in the log and
        tried again at the next tick: the screen never goes down with it."""
        try:
            return read()
        except Exception as e:
            text = f"reading {self.run_dir.name}: {type(e).__name__}: {e}"
            self.post_message(Notice(text, False))
            return False

    # -- drawing -----------------------------------------------------------------------------
    def on_run_updated(self, message: RunUpdated) -> None:
        s = message.snapshot
        self.snapshot = s
        self._acks(s)
        self.query_one("#header", RunHeader).show(s, self.last_command, self.readonly)
        now = time.monotonic()
        self._chart_titles(s)  # every snapshot, like the header: one loss on the screen
        if now - self._plotted >= CHART_EVERY_S or not s.live:
            self._plotted = now
            self._plot(s)
        self.query_one("#devices", DevicePanel).show(s.devices)
        self.query_one("#checkpoints", CheckpointList).show(s.checkpoints, s.now)
        routed = bool(expert_loads(s.train_metrics))  # a mixture of experts' run
        self.set_class(routed, "-experts")
        if routed:
            self.query_one("#experts", ExpertPanel).show(s.train_metrics)
            self.query_one("#experts-box").border_subtitle = even_share_text(s.train_metrics)
        self._newest_checkpoint(s, routed)
        log = self.query_one("#log", RichLog)
        for line in s.new_logs:
            log.write(Text(line.text, style=LOG_STYLE.get(line.level, "")))
        failed = bool(s.failure) and s.state == "failed"
        self.set_class(failed, "-failed")
        if failed:
            self.query_one("#failure", FailurePanel).show(s.failure or {}, s.reason)
        if self._was_live != s.live:
            self._was_live = s.live
            self.refresh_bindings()
        self.updates += 1

    def _chart_titles(self, s: RunSnapshot) -> None:
        """The charts' numbers: the same snapshot's as the header's (the lines may lag)."""
        window = WINDOWS[self.window]
        span = "whole run" if window is None else f"last {window:,} steps"
        subtitle = span + (" · sampled" if s.sampled and window is None else "")
        name = self.series if self.series in s.metric_series else "loss"
        if s.keep_best and s.keep_best != (s.eval_name if name == "loss" else name):
            # The best checkpoint is kept by another metric than the one drawn: say which.
            value = num(s.eval_latest.get(s.keep_best))
            subtitle = f"[{EVAL}]★[/] best by {escape(s.keep_best)} {value} · {subtitle}"
        if name != "loss":  # a task metric: its newest value; m cycles back to the loss
            value = num(s.train_metrics.get(name))
            self.query_one("#loss", BrailleChart).titles(
                f"{escape(name)}  [{TRAIN}]━ train {value}[/]", subtitle
            )
        else:
            self._loss_title(s, subtitle)
        unit, now = "samples/s", s.samples_per_s
        if s.tokens_points:
            unit, now = "tokens/s", s.tokens_per_s
        self.query_one("#throughput", BrailleChart).titles(f"{unit} [{RATE}]{num(now)}[/]")
        self.query_one("#lr", BrailleChart).titles(f"lr [{LR}]{num(s.lr, 3)}[/]")

    def _loss_title(self, s: RunSnapshot, subtitle: str) -> None:
        title = f"[{TRAIN}]━ train {num(s.loss)}[/]"
        if s.eval_name:
            title += f"  [{EVAL}]• eval {s.eval_name} {num(s.eval_latest.get(s.eval_name))}[/]"
        self.query_one("#loss", BrailleChart).titles(f"loss  {title}", subtitle)

    def _plot(self, s: RunSnapshot) -> None:
        window = WINDOWS[self.window]
        train = s.loss_series.view(window)
        lo = train[0][0] if train and window is not None else None
        chart = self.query_one("#loss", BrailleChart)
        if (metric := s.metric_series.get(self.series)) is not None:
            chart.plot([Line(self.series, metric.view(window), TRAIN)])
        else:
            evals = [p for p in s.eval_points if lo is None or p[0] >= lo]
            chart.plot(
                [Line("train", train, TRAIN), Line("eval", evals, EVAL, marker=True)],
                empty=s.startup or "waiting for the first step…",
            )
        rate = self.query_one("#throughput", BrailleChart)
        # Tokens/s where the task reports tokens (sequence models), else samples/s.
        unit, pts = "samples/s", s.throughput_points
        if s.tokens_points:
            unit, pts = "tokens/s", s.tokens_points
        rate.plot([Line(unit, [p for p in pts if lo is None or p[0] >= lo], RATE)])
        lr = self.query_one("#lr", BrailleChart)
        lr.plot([Line("lr", [p for p in s.lr_points if lo is None or p[0] >= lo], LR)])

    # -- commands ----------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CONTROL_ACTIONS:
            # Read-only viewers and ended runs have no such keys (the header says why).
            return not self.readonly and self.snapshot is not None and self.snapshot.live
        return True

    def _acks(self, s: RunSnapshot) -> None:
        log = self.query_one("#log", RichLog)
        for cid, p in self.pending.items():
            e = s.controls.get(cid)
            if e is None or e.get("state") == p["state"]:
                continue
            p["state"], p["step"] = e.get("state"), e.get("step")
            mark = {"done": "✓", "rejected": "✗"}.get(p["state"], "…")
            text = f"{p['cmd']} {mark} {p['state']} @ step {p['step']}"
            held = e.get("checkpoint")  # a request answered by the step's earlier checkpoint
            if isinstance(held, dict) and held.get("reason") != "request":
                text += f" (its {held.get('reason')} checkpoint)"
            if p["cmd"] == "profile" and p["state"] == "done" and e.get("path"):
                text += f": {e['path']}"  # the trace directory
                self.notify(f"trace of steps {e.get('first_step')}-{e.get('last_step')}: "
                            f"{e['path']}", title="profile", timeout=10)  # fmt: skip
            elif p["state"] == "rejected" and e.get("reason"):
                text += f": {e['reason']}"
            style = "#ff5f5f" if p["state"] == "rejected" else "#5fd787"
            self.last_command = Text(text, style=style)
            log.write(Text(f"← {text}", style=LOG_STYLE["command"]))

    def send(self, cmd: str, **args: Any) -> None:
        """Append ``cmd`` to control.jsonl (in a thread); its acks show as they arrive."""
        self.last_command = Text(f"{cmd} sent…", style="#ffd75f")
        self._append(cmd, args)

    @work(thread=True, group="control", exit_on_error=False)
    def _append(self, cmd: str, args: dict[str, Any]) -> None:
        if is_held(self.run_dir) is False:  # no session reads control.jsonl (lock.py)
            self.post_message(ControlSent(cmd, None, "no session is running the run"))
            return
        try:
            cid = append_control(self.run_dir, cmd, **args)
        except OSError as e:
            self.post_message(ControlSent(cmd, None, f"{e.strerror or e}"))
            return
        self.post_message(ControlSent(cmd, cid))

    def on_control_sent(self, message: ControlSent) -> None:
        log = self.query_one("#log", RichLog)
        if message.cid is None:
            self.last_command = Text(f"{message.cmd} failed: {message.error}", style="#ff5f5f")
            log.write(Text(f"→ {message.cmd} could not be sent: {message.error}", style="red"))
        else:
            self.pending[message.cid] = {"cmd": message.cmd, "state": "sent", "step": None}
            log.write(Text(f"→ {message.cmd} sent (id {message.cid})", style="#5fd787"))
        if self.snapshot is not None:
            self.query_one("#header", RunHeader).show(
                self.snapshot, self.last_command, self.readonly
            )

    def action_checkpoint(self) -> None:
        self.send("checkpoint")

    def action_profile(self) -> None:
        self.send("profile", steps=PROFILE_STEPS)

    def action_pause(self) -> None:
        paused = self.snapshot is not None and self.snapshot.state == "paused"
        self.send("resume" if paused else "pause")

    def action_stop(self) -> None:
        def answer(yes: bool | None) -> None:
            if yes:
                self.send("stop")

        why = "It finishes the step, writes a checkpoint and exits (state stopped)."
        s = self.snapshot
        if s is not None and s.state == "stalled":  # the step may never end: say so now
            why = (
                f"The run is stalled ({s.reason}): a graceful stop waits for a step boundary "
                "it may never reach. k kills it now (no checkpoint)."
            )
        self.app.push_screen(ConfirmScreen("Stop the run?", why), answer)

    def action_kill(self) -> None:
        def answer(yes: bool | None) -> None:
            if yes:
                self.last_command = Text("kill sent…", style="#ff5f5f")
                self._kill()

        self.app.push_screen(
            ConfirmScreen(
                "Kill the run now?",
                "Its processes are killed at once: no checkpoint is written (state killed).",
            ),
            answer,
        )

    @work(thread=True, group="control", exit_on_error=False)
    def _kill(self) -> None:
        from ...commands.runs import stop_now
        from ...runs import RunDirError

        try:
            stop_now(str(self.run_dir), self.run_dir.parent, wait_s=0)
        except (RunDirError, OSError) as e:
            self.post_message(Notice(f"kill: {e}", False))
            return
        self.post_message(Notice("kill: the supervisor is killing the run", True))

    def on_notice(self, message: Notice) -> None:
        style = "#ff5f5f" if not message.ok else "#ffaf5f"
        self.last_command = Text(message.text, style=style)
        self.query_one("#log", RichLog).write(Text(message.text, style=style))

    def action_report(self) -> None:
        self.last_command = Text("writing the report…", style="#ffd75f")
        self._report()

    @work(thread=True, group="report", exclusive=True, exit_on_error=False)
    def _report(self) -> None:
        """``gpu-console report`` of this run (results/report.py), in a thread: matplotlib
        is imported here, on the key, never at the console's start."""
        from ...results import report
        from ...runs import RunDirError

        try:
            data = report.load(self.run_dir, self.run_dir.parent)
            index, _ = report.write([data], report.default_out([self.run_dir]))
        except (RunDirError, OSError) as e:
            text = str(e) if str(e).startswith("report:") else f"report: {e}"  # ReportError says so
            self.post_message(Notice(text, False))
            return
        self.post_message(Notice(f"report written: {index}", True))
        self.app.call_from_thread(
            self.notify, f"open it in a browser: {index}", title="report", timeout=10
        )

    def action_detach(self) -> None:
        s = self.snapshot
        if s is not None and s.live:
            self.app.finish(
                0,
                f"detached from {self.run_dir.name}: it keeps training. "
                f"Reattach: gpu-console attach {self.run_dir}",
            )
        else:
            self.app.finish(self.exit_code())

    def action_window(self) -> None:
        self.window = (self.window + 1) % len(WINDOWS)
        if self.snapshot is not None:
            self._chart_titles(self.snapshot)
            self._plot(self.snapshot)

    def action_series(self) -> None:
        """The main chart's next series: the loss, then each of the task's train metrics."""
        names = ["loss", *(self.snapshot.metric_series if self.snapshot else ())]
        at = names.index(self.series) if self.series in names else 0
        self.series = names[(at + 1) % len(names)]
        if self.snapshot is not None:
            self._chart_titles(self.snapshot)
            self._plot(self.snapshot)

    def exit_code(self) -> int:
        s = self.snapshot
        if s is None:
            return 0
        from ...runs import read_status

        return exit_code_of(s, bool(read_status(self.run_dir).get("checkpointed_on_stop")))

    @property
    def live(self) -> bool:
        return self.snapshot is not None and self.snapshot.live
