"""``--headless``: follow a run from its directory, report progress, end with a summary.

On a terminal: one Rich progress line. Elsewhere (CI, nohup, ``| tee``): a plain line at
the first step, then every few seconds on a steady beat, and at the end; one for each notable
event; never a flood of carriage returns, never a line cut at a width.
Ctrl-C: first a graceful stop (checkpoint, exit 0); the second kills the run now, no
checkpoint (the supervisor records ``interrupted``, exit 130); a third, should the supervisor
not answer, kills the run's processes from here.
SIGTERM/SIGUSR1 to this process (a scheduler signalling every process of the job step, this
console with them): the run's graceful stop, as if the supervisor had been signalled; the
console follows it to its end. One that came while the command was still starting was held
(held_signals.py) and is passed on here. A requeue's end waits for scontrol's answer, so the
summary says what SLURM did.
SIGHUP (the terminal went away) ends this console only: the run goes on, and its run
directory keeps the whole history for a later ``attach`` or ``ls``.
A run with no step for too long is shown ``stalled``, naming the ranks that stopped.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from . import held_signals
from .events import append_control
from .exit_watch import ExitWatch
from .fold import with_signs
from .format import (
    compiling_text,
    early_stop_line,
    eval_progress_text,
    fmt,
    human_bytes,
    human_duration,
    optimizer_line,
    steps_text,
    strategy_text,
    uncut,
)
from .heartbeats import all_beating
from .lost import settle
from .resume_changes import line as change_line
from .runs import EXIT_FAILED
from .stall import quiet_s
from .state import (
    HEARTBEAT_SILENT_S,
    RunFollower,
    RunState,
    describe_stopped,
    read_heartbeats,
)
from .summary import env_text, print_summary, requeue_unanswered

POLL_S = 0.2


class Interrupts:
    """Ctrl-C escalation: stop with a checkpoint → the supervisor kills the run (interrupted)
    → this console kills the tree itself.

    The signal handler only counts presses; :meth:`act` (called from the follow loop) does
    the work, so a second Ctrl-C arriving mid-print never re-enters I/O.
    """

    def __init__(self, run_dir: Path, follower: RunFollower, console: Console):
        self.run_dir, self.follower, self.console = run_dir, follower, console
        self.count = 0
        self.acted = 0

    def __call__(self, signum, frame) -> None:
        self.count += 1

    def act(self) -> None:
        while self.acted < self.count:
            self.acted += 1
            sup = self.follower.state.status.get("pids", {}).get("supervisor")
            if self.acted == 1:
                append_control(self.run_dir, "stop")
                self.console.print(
                    "stopping: finishing the step and writing a checkpoint "
                    "(Ctrl-C again to kill it now, no checkpoint)",
                    style="yellow",
                )
            elif self.acted == 2:
                if sup:
                    _signal(sup, signal.SIGINT)  # supervisor.KILLS: interrupted, exit 130
                self.console.print(f"interrupting: killing the run now; {self._checkpoint()}",
                                   style="red", highlight=False)  # fmt: skip
            elif self.acted == 3:
                if sup:
                    kill_tree(sup)
                self.console.print("killed its processes from this console", style="red")

    def _checkpoint(self) -> str:
        """What the second Ctrl-C finds of the stop's checkpoint (the end says what was kept:
        a checkpoint that lands before the kill is the run's, and it ends ``stopped``)."""
        written = stop_checkpoint(self.follower.state)
        if written is not None:
            return f"its stop checkpoint @ step {written.get('step')} is written"
        return "the stop checkpoint is not written yet"


def stop_checkpoint(st: RunState) -> dict | None:
    """This session's checkpoint of a graceful stop (a request or a signal), once seen."""
    since = st.status.get("started") or st.session_started or 0
    for e in reversed(st.checkpoints):
        if e.get("reason") in ("stop", "signal") and (e.get("t") or 0) >= since:
            return e
    return None


class SchedulerSignals:
    """SIGTERM/SIGUSR1 to the console → the supervisor's graceful stop (it coalesces)."""

    def __init__(self, follower: RunFollower, console: Console, supervisor: int | None = None):
        self.follower, self.console = follower, console
        self.supervisor = supervisor  # its pid, before status.json names it
        self.received: list[int] = []
        self.acted = 0

    def __call__(self, signum, frame) -> None:
        self.received.append(signum)

    def act(self) -> None:
        while self.acted < len(self.received):
            signum = self.received[self.acted]
            self.acted += 1
            sup = self.follower.state.status.get("pids", {}).get("supervisor") or self.supervisor
            if sup:  # the same signal: SIGUSR1 may mean "requeue the job" (cluster.requeue_signal)
                _signal(sup, signum)
            if self.acted == 1:
                self.console.print(
                    Text(
                        f"{signal.Signals(signum).name}: stopping the run at the next step "
                        "with a checkpoint",
                        style="yellow",
                    ),
                    highlight=False,
                )


class Stalls:
    """Says once when the run stalls (and which ranks stopped), and once when it moves again."""

    def __init__(self, run_dir: Path, follower: RunFollower, console: Console):
        self.run_dir, self.follower, self.console = run_dir, follower, console
        self.stalled_since: float | None = None
        self.said = False

    def check(self) -> bool:
        st = self.follower.state
        now = time.time()
        stalled = not st.done and st.shown_state(now) == "stalled"
        if stalled and not self.said:
            self.said = True
            quiet = quiet_s(with_signs(st, st.status), now, self.run_dir)
            self.stalled_since = now - quiet if quiet is not None else now
            who = describe_stopped(read_heartbeats(self.run_dir), now)
            # Frozen before its first step (a silent heartbeat): no step to be late for.
            text = f"stalled: no step for {quiet:.0f} s" if quiet else f"stalled ({st.state})"
            if who:
                text += f"; stopped: {who}"
            said = Text.assemble((text, "red"))
            if py_spy_available():
                said.append(f"\n  each rank's stack: gpu-console dump {self.run_dir}")
            # One write: a reader of the output never sees the stall without its advice.
            self.console.print(said, highlight=False)
        elif not stalled and self.said and self._moving(st, now):
            self.said = False
            self.console.print(Text(f"{st.state} again"), highlight=False)
        return stalled

    def _moving(self, st: RunState, now: float) -> bool:
        """Moving again: every rank there and beating (a stalled step that went on, a frozen
        rank continued); not a run whose ranks were killed (no longer frozen, not moving)."""
        return not st.done and all_beating(self.run_dir, now, HEARTBEAT_SILENT_S)


def py_spy_available() -> bool:
    from .commands.runs import py_spy

    return py_spy() is not None


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_tree(pid: int) -> None:
    """SIGKILL every descendant of the supervisor; it stays to record the end."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for p in children:
        with contextlib.suppress(psutil.Error):
            p.kill()


class ReaderMayLeave:
    """Standard output that a reader who leaves (``| head``) cannot end the console with: the
    run goes on either way (its supervisor is detached), so the console goes on following it,
    silently, and exits with the run's exit code, not 1 for a closed pipe."""

    def __init__(self, inner):
        self.inner = inner
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.inner.write(text)
            except BrokenPipeError:
                self._left()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.inner.flush()
            except BrokenPipeError:
                self._left()

    def _left(self) -> None:
        # What is still buffered, and what the interpreter flushes at exit, goes nowhere
        # instead of failing again on the closed pipe.
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.inner.fileno())
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def follow(
    run_dir: Path,
    supervisor: subprocess.Popen | None = None,
    console: Console | None = None,
    plain_every_s: float | None = None,
) -> int:
    """Report a run until it ends; return the console's exit code (DESIGN.md)."""
    if console is None and not isinstance(sys.stdout, ReaderMayLeave):
        sys.stdout = ReaderMayLeave(sys.stdout)  # Rich's Console writes to sys.stdout
    console = uncut(console or Console())  # off a terminal no line is wrapped or cut
    tty = console.is_terminal
    if plain_every_s is None:
        plain_every_s = plain_beat_s()
    follower = RunFollower(run_dir)
    interrupts = Interrupts(run_dir, follower, console)
    scheduler = SchedulerSignals(follower, console, supervisor.pid if supervisor else None)
    stalls = Stalls(run_dir, follower, console)
    watch = Watch(interrupts, scheduler, stalls)
    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in (
            (signal.SIGINT, interrupts),
            (signal.SIGTERM, scheduler),
            (signal.SIGUSR1, scheduler),
        )
    }
    held_signals.release()  # held since the command began (entry.py): handled from here on
    if resumed := _resumed_line(run_dir):
        console.print(resumed, highlight=False)
    console.print(Text.assemble("run ", (run_dir.name, "bold"), f"  ({run_dir})"))
    # Polls end early when the supervisor exits: the run's end is seen at once.
    watch.supervisor_exit = ExitWatch(supervisor.pid if supervisor is not None else None)
    try:
        if tty:
            _follow_tty(follower, supervisor, console, watch)
        else:
            _follow_plain(follower, supervisor, console, watch, plain_every_s)
    finally:
        watch.supervisor_exit.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    st = follower.state
    print_summary(console, st, run_dir)
    return exit_code(st)


def _resumed_line(run_dir: Path) -> Text | None:
    """``resumed from RUN at step N``: a resumed session's first line (None for a new run)."""
    from .runs import current_session, read_json

    meta = read_json(run_dir / "meta.json")
    resumed = current_session(meta).get("resume_from") if isinstance(meta, dict) else None
    if not isinstance(resumed, str):
        return None
    ckpt = Path(resumed)  # RUN/checkpoints/step-N
    written = read_json(ckpt / "meta.json")
    step = written.get("step") if isinstance(written, dict) else None
    at = f" at step {step}" if isinstance(step, int) else ""
    return Text.assemble("resumed from ", (ckpt.parent.parent.name, "bold"), at)


class Watch:
    """What the follow loop acts on besides events: Ctrl-C, scheduler signals, stalls."""

    def __init__(self, interrupts: Interrupts, scheduler: SchedulerSignals, stalls: Stalls):
        self.interrupts, self.scheduler, self.stalls = interrupts, scheduler, stalls
        self.supervisor_exit = ExitWatch(None)
        self.requeue_said = False


def _tick(
    follower: RunFollower,
    supervisor: subprocess.Popen | None,
    console: Console,
    watch: Watch,
    held: list[dict] | None = None,
) -> bool:
    """Act on signals, read what is new, print what is notable; True once the run has ended.
    ``held``: checkpoint events go there, for the plain follower to print in step order."""
    watch.interrupts.act()
    watch.scheduler.act()
    if supervisor is not None:
        supervisor.poll()  # reap our child, so no zombie piles up
    for e in follower.poll():
        if held is not None and e.get("kind") == "checkpoint":
            held.append(e)
        else:
            _notable(e, console)
    st = follower.state
    # A requeue that scontrol refuses ends the run stopped: its answer is waited for. One it
    # grants ends this console with the job's other processes, often before the answer: the
    # line is said first.
    waiting = requeue_unanswered(st.status) and not _supervisor_gone(follower, supervisor)
    if waiting and not watch.requeue_said:
        watch.requeue_said = True
        command = " ".join(st.status["requeue"].get("command") or [])
        console.print(f"requeue asked: {command} (the next start continues the run)",
                      highlight=False)  # fmt: skip
    if st.done and not waiting:
        return True
    watch.stalls.check()
    if _supervisor_gone(follower, supervisor):
        # It may have written its last status just before exiting; if not, this reader
        # records the run lost in status.json, so that every view says the same (lost.py).
        settle(follower.run_dir)
        follower.poll()
        if not st.done:
            st.state, st.reason = "lost", "the supervisor exited without recording an end"
        return True
    return False


def _supervisor_gone(follower: RunFollower, supervisor: subprocess.Popen | None) -> bool:
    # Our own child, where we started it, is the authority: status.json may never name its pid
    # (the run directory was removed under us), and the pidfd the loop sleeps on stays
    # readable once it has exited, so waiting on the file alone would spin forever.
    if supervisor is not None and supervisor.returncode is not None:
        return True
    return not follower.supervisor_alive()


def _notable(e: dict, console: Console) -> None:
    """One line for an event worth a line. Event text is printed as is, never as markup."""

    def say(text: str, style: str | None = None) -> None:
        console.print(Text(text, style=style or ""), highlight=False)

    kind = e.get("kind")
    if kind == "start" and e.get("restart"):
        where = (
            f"resumed from step {e.get('start_step')}"
            if e.get("resumed_from")
            else "no checkpoint yet: from the start"
        )
        say(
            f"restart {e.get('restart')} of {e.get('max_restarts')}: torchrun restarted the "
            f"ranks; {where}",
            "yellow",
        )
    elif kind == "start":
        say(
            f"started: {e.get('world_size')} × {e.get('device_type')} ranks, "
            f"{e.get('precision')}, task {e.get('task')}, {e.get('params'):,} parameters, "
            f"{strategy_text(e)}"
        )
        for o in e.get("optimizers") or []:
            say(f"  {optimizer_line(o)}")
        if e.get("auto_batch"):
            say(f"  {auto_batch_line(e)}")
        if e.get("env"):  # distributed.env, set in each rank before torch started
            say(f"  distributed.env: {env_text(e['env'])}")
        for change in e.get("changes") or []:  # a resumed run's, against the run it resumes
            say(f"  {change_line(change)}", "yellow" if change.get("class") == "warning" else None)
        if (e.get("nodes") or 1) > 1:
            where = e.get("rank_0") or {}
            say(
                f"node {e.get('node')} of {e.get('nodes')}; rank 0 (checkpoints, events of "
                f"record) on {where.get('host')}: {where.get('run_dir')}"
            )
    elif kind == "eval":
        names = [k for k in e if k not in ("v", "t", "kind", "step")]
        # A table of figures (``a/b/c``: moe_mnist's expert activations per class) is the
        # report's to draw; the line says how many it leaves out.
        table = [k for k in names if k.count("/") >= 2]
        metrics = "  ".join(f"{k} {fmt(e[k])}" for k in names if k not in table)
        more = f"  (+{len(table)} per-class figures: gpu-console report)" if table else ""
        say(f"eval @ step {e.get('step')}: {metrics}{more}")
    elif kind == "early_stop":
        say(early_stop_line(e), "yellow" if e.get("stop") else None)
    elif kind == "progress" and e.get("phase") == "eval":
        say(f"{eval_progress_text(e)} @ step {e.get('step')}")  # about once a second
    elif kind == "checkpoint":
        say(
            f"checkpoint @ step {e.get('step')} ({e.get('reason')}): "
            f"{human_bytes(e.get('bytes'))} in {e.get('seconds', 0):.2f}s"
            + (f" (training blocked {e['blocked_s']:.2f}s)" if "blocked_s" in e else "")
            + (f", best {e.get('metric')} {fmt(e.get('value'))}" if e.get("best") else "")
        )
    elif kind == "profile":  # the profile command's traces (engine/torch_profiler.py)
        say(f"profile: steps {e.get('first_step')}-{e.get('last_step')} traced: {e.get('path')}")
    elif kind == "status" and e.get("state") == "restarting":
        say(f"a rank failed; torchrun restarts the ranks: {e.get('reason') or ''}", "yellow")
    elif kind == "status" and e.get("state") == "compiling":
        say(f"compiling the model ({e.get('reason')}): the first step waits for it")
    elif kind == "status" and type(e.get("compiled_s")) in (int, float):
        say(f"compiled in {e['compiled_s']:.1f} s")
    elif kind == "status" and e.get("state") == "stopping":
        why = STOPPING.get(e.get("reason"), e.get("reason"))
        say(f"state: stopping ({why})" if why else "state: stopping")
    elif kind == "status" and e.get("state") in ("paused", "failed", "refused"):
        say(f"state: {e.get('state')} {e.get('reason') or ''}".rstrip())
    elif kind == "log" and e.get("level") in ("warning", "error"):
        say(f"{e.get('level')}: {e.get('message')}", "yellow")
    elif kind == "log" and e.get("source") == "task":  # the task's ctx.log, info included
        say(f"{e.get('level')}: {e.get('message')}")


# Why the engine stops (its ``stopping`` event's reason), as a line says it.
STOPPING = {"stop": "on request", "signal": "on a signal", "nan": "non-finite loss"}


def auto_batch_line(start: dict) -> str:
    """``batch size 24 per rank (auto: 9 sizes tried in 0.1 s, global 48)``."""
    ab = start.get("auto_batch") or {}
    return (
        f"batch size {ab.get('chosen')} per rank (auto, by {ab.get('rule')}: "
        f"{len(ab.get('tried') or [])} sizes tried in {ab.get('seconds', 0):.1f} s; "
        f"global batch {start.get('global_batch')})"
    )


def _progress_text(st: RunState) -> str:
    rate = f"{st.samples_per_s:,.0f} samples/s" if st.samples_per_s else "- samples/s"
    mfu = f"  MFU {st.mfu:.1%}" if st.mfu is not None else ""
    evaluating = f"  {eval_progress_text(st.eval_progress)}" if st.eval_progress else ""
    skipped = f"  skipped {st.skipped:,}" if st.skipped else ""  # nan_policy = "skip"
    return f"loss {fmt(st.loss)}  {rate}{mfu}{skipped}{evaluating}"


def _follow_tty(follower: RunFollower, supervisor, console: Console, watch: Watch) -> None:
    columns = (
        TextColumn("[bold]{task.fields[state]}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False, refresh_per_second=8) as bar:
        task = bar.add_task("train", total=None, state="starting", info="")
        while True:
            ended = _tick(follower, supervisor, console, watch)
            st = follower.state
            shown = "stalled" if watch.stalls.said else st.state
            if shown == "compiling":
                shown = compiling_text(st.compiling_since, time.time())
            if st.session_began:  # before it, the figures are an earlier session's
                info = _progress_text(st)
                total = st.max_steps or None  # until stopped: no bar's end
                bar.update(task, total=total, completed=st.step, state=shown, info=info)
            else:
                bar.update(task, state=shown)
            if ended:
                break
            watch.supervisor_exit.sleep(POLL_S)


COMPILING_EVERY_S = 10.0  # plain lines while train.compile compiles the first step
PLAIN_EVERY_S = 2.0  # a run of a few seconds gets several lines; a long one, one per beat
MIN_BEAT_S = 0.1


def plain_beat_s() -> float:
    """Seconds between plain progress lines (``$GPU_CONSOLE_PLAIN_EVERY_S``, default 2)."""
    try:
        return max(MIN_BEAT_S, float(os.environ.get("GPU_CONSOLE_PLAIN_EVERY_S", PLAIN_EVERY_S)))
    except ValueError:
        return PLAIN_EVERY_S


class Rhythm:
    """When a plain progress line is due: at the first step, then every ``every_s`` seconds
    of wall time on a fixed beat (a slow poll skips a beat, never shifts the later ones), and
    at the end when the last line did not show the final step. A beat with no new step (a
    paused run, one waiting on another node) prints nothing: its state has a line of its own."""

    def __init__(self, every_s: float):
        self.every_s = max(MIN_BEAT_S, every_s)
        self.next_t: float | None = None
        self.shown_step: int | None = None

    def due(self, now: float, step: int, ended: bool) -> bool:
        if not step or step == self.shown_step:
            return False
        return self.next_t is None or ended or now >= self.next_t

    def shown(self, now: float, step: int) -> None:
        self.shown_step = step
        if self.next_t is None:
            self.next_t = now
        while self.next_t <= now:
            self.next_t += self.every_s


def _follow_plain(
    follower: RunFollower, supervisor, console: Console, watch: Watch, every_s: float
) -> None:
    rhythm = Rhythm(every_s)
    compiling = Rhythm(max(every_s, COMPILING_EVERY_S))
    held: list[dict] = []
    while True:
        ended = _tick(follower, supervisor, console, watch, held)
        st = follower.state
        now = time.monotonic()
        # Lines in step order: a checkpoint of an earlier step (a background write settles
        # after later steps) before this progress line, one of its step after its step's.
        _release(held, console, st.step - 1)
        if st.state == "compiling" and not ended:
            # No step for a minute is no stall here: say how long the compile has taken.
            beat = int(time.time() - (st.compiling_since or time.time())) + 1
            if compiling.due(now, beat, False):
                console.print(Text(compiling_text(st.compiling_since, time.time())))
                compiling.shown(now, beat)
        if st.session_began and rhythm.due(now, st.step, ended):
            eta = human_duration(st.eta_s())
            stalled = "  STALLED" if watch.stalls.said else ""
            console.print(
                Text(
                    f"step {steps_text(st.step, st.max_steps)}  {_progress_text(st)}  "
                    f"eta {eta}{stalled}"
                ),
                highlight=False,
            )
            rhythm.shown(now, st.step)
        _release(held, console, math.inf if ended else rhythm.shown_step or 0)
        if ended:
            return
        watch.supervisor_exit.sleep(POLL_S)


def _release(held: list[dict], console: Console, upto: float) -> None:
    """Print the held checkpoint lines of steps up to ``upto`` (one with no step at once)."""
    for e in list(held):
        step = e.get("step")
        if not isinstance(step, int) or step <= upto:
            held.remove(e)
            _notable(e, console)


def exit_code(st: RunState) -> int:
    """The run's exit code (:func:`runs.exit_code`: the number status.json holds)."""
    code = st.exit_code
    return EXIT_FAILED if code is None else code
