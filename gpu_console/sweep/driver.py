"""``python -m gpu_console.sweep.driver SWEEP_DIR --lock-fd FD``: a sweep's driver.

A detached process (a session of its own, as a run's supervisor): closing the console or
losing SSH changes nothing. It holds the sweep's lock for as long as it lives (one driver
at a time), starts each trial as ``gpu-console run`` would (``launch.prepare`` and
``launch.start``: every trial is an ordinary run with a supervisor of its own) on a free slot
(slots.py), records each trial's start and end in ``sweep.jsonl``, and ends the sweep when
every trial has ended or the budget is spent.

Started again on a sweep (``gpu-console sweep --resume``) after a crash, a ``kill -9`` or a
reboot, it keeps what the events say ended, takes back the trials still running (their
supervisors outlive any driver), resumes from its checkpoint every trial that ended without
finishing, and goes on. No torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import launch, lost, runs, session_lock
from ..events import JsonlTail, append_control
from ..profile import ProfileError
from ..runs import RunDirError
from . import store
from .slots import Slot
from .spec import trial_sets
from .store import add_eval, better, eval_curve, last
from .study import Study
from .study import available as study_available

POLL_S = 0.25
# The ends a trial's run may record while no driver watched it that its checkpoint continues.
RESUMABLE = ("stopped", "requeued", "interrupted", "killed", "lost")


class Driver:
    def __init__(self, sweep_dir: Path):
        self.dir = Path(sweep_dir)
        self.plan = store.read_plan(self.dir)
        self.trials = {t["trial"]: t for t in self.plan["trials"]}
        self.slots = [Slot.from_dict(s) for s in self.plan["slots"]]
        self.free = list(self.slots)
        self.live: dict[int, tuple[Slot, Path, Any]] = {}  # trial → (slot, run, supervisor)
        self.queue: list[tuple[int, Path | None]] = []  # (trial, its run to resume or None)
        self.session = uuid.uuid4().hex[:8]
        past = store.read_events(self.dir)
        self.resumed = any(e.get("kind") == "sweep" for e in past)
        self.used_before = _used_seconds(past)
        self.began = time.monotonic()
        self.stop_asked = ""
        self.stop_sent = False
        control = self.dir / store.CONTROL
        # Commands given to an earlier driver were answered by it (or died with it).
        self.control = JsonlTail(control, control.stat().st_size if control.exists() else 0)
        self.folded = store.fold(past, self.plan)
        # Pruning: every trial's objective at each eval step (its value, or its best so far),
        # the finished trials', and the live trials' event tails.
        self.evals: dict[int, dict[int, float]] = {}
        self.finished: set[int] = set()
        self.tails: dict[int, JsonlTail] = {}
        self.pruning: dict[int, str] = {}  # trial → why it was asked to stop
        # With Optuna installed, every trial is one of the study in the sweep's directory
        # (study.py); a tpe search needs it, a grid or random one only mirrors into it.
        self.study = open_study(self.dir, self.plan)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        store.append_event(self.dir, "sweep", state="running", session=self.session,
                           pid=os.getpid(), resumed=self.resumed)  # fmt: skip
        self.recover()
        while True:
            self.read_control()
            self.reap()
            if self.stop_asked:
                if not self.stop_sent:
                    for _, run, _ in self.live.values():
                        with contextlib.suppress(OSError):
                            append_control(run, "stop")
                    self.stop_sent = True
                if not self.live:
                    return self.end("stopped", self.stop_asked)
            else:
                spent = self.budget_spent()
                while self.free and self.queue and not spent:
                    trial, resume = self.queue.pop(0)
                    self.start(trial, self.free.pop(0), resume)
                if not self.live and (not self.queue or spent):
                    return self.end("finished", spent or "every trial ended")
            time.sleep(POLL_S)

    def end(self, state: str, reason: str) -> int:
        folded = store.fold(store.read_events(self.dir), self.plan)
        best = folded["best"]
        store.append_event(
            self.dir, "sweep", state=state, reason=reason, session=self.session,
            best=None if best is None else {k: best[k] for k in ("trial", "run", "objective")},
        )  # fmt: skip
        return 0

    def budget_spent(self) -> str:
        minutes = float(self.plan["sweep"].get("max_minutes") or 0)
        used = self.used_before + time.monotonic() - self.began
        if minutes and used >= minutes * 60:
            return f"max_minutes reached ({minutes:g})"
        return ""

    def read_control(self) -> None:
        for cmd in self.control.read():
            if cmd.get("cmd") == "stop" and not self.stop_asked:
                self.stop_asked = "stop asked"
            elif cmd.get("cmd") in ("stop_trial", "prune") and cmd.get("trial") in self.live:
                n = cmd["trial"]
                _, run, _ = self.live[n]
                if cmd["cmd"] == "prune" and n not in self.pruning:
                    self.pruning[n] = "pruned by hand"
                    store.append_event(self.dir, "trial", trial=n, state="pruning",
                                       reason=self.pruning[n])  # fmt: skip
                with contextlib.suppress(OSError):
                    append_control(run, "stop")

    # -- trials --------------------------------------------------------------------------------

    def recover(self) -> None:
        """What the events and the trials' runs say, before anything starts: ended trials
        kept, live ones taken back on their slots, the others queued (resumes first)."""
        resumes: list[tuple[int, Path | None]] = []
        fresh: list[tuple[int, Path | None]] = []
        for row in self.folded["trials"]:
            n, state = row["trial"], row["state"]
            run = self.dir / row["run"] if row["run"] else None
            if state == "finished" and run is not None:
                self.finished.add(n)
                self.evals[n] = eval_curve(run, self.plan["objective"])
            if state in ("finished", "failed", "pruned"):
                continue
            if state == "pending" or run is None or not run.is_dir():
                fresh.append((n, None))
                continue
            status = lost.settle(run)
            if state == "pruning":
                self.pruning[n] = row["reason"]
                if status.get("ended"):
                    self.record_end(n, run, status)
                    continue
            if state in ("running", "pruning") and not status.get("ended"):
                slot = next((s for s in self.free if s.devices == row["devices"]), None)
                if slot is not None:
                    self.free.remove(slot)
                    self.live[n] = (slot, run, None)
                    store.append_event(self.dir, "trial", trial=n, state="adopted",
                                       run=run.name, devices=slot.devices)  # fmt: skip
                    continue
            if status.get("state") == "finished":
                self.record_end(n, run, status)
            else:
                resumes.append((n, run))
        if self.plan["sweep"]["search"] == "tpe":  # its trials are asked for as slots free up
            fresh += [(n, None) for n in range(len(self.trials), self.plan["sweep"]["trials"])]
        self.queue = resumes + fresh

    def start(self, n: int, slot: Slot, resume: Path | None) -> None:
        if n not in self.trials:  # tpe: Optuna chooses its values now
            assert self.study is not None
            params = self.study.begin(n, None)
            keys = self.plan["sweep"]["parameters"]
            params = {k: params[k] for k in keys}
            self.trials[n] = {"trial": n, "params": params,
                              "sets": trial_sets(self.plan["sweep"]["set"], params)}  # fmt: skip
            self.plan["trials"].append(self.trials[n])
            store.write_plan(self.dir, self.plan)
        elif self.study is not None:
            self.study.begin(n, self.trials[n]["params"])
        trial = self.trials[n]
        if resume is not None and runs.latest_checkpoint(resume) is None:
            resume = None  # ended before its first checkpoint: it starts again, beside it
        exact = not (self.dir / store.trial_name(n)).exists()
        try:
            with pinned(slot.cores):
                if resume is not None:
                    prof, placement, resume_from = launch.prepare(
                        None, devices=slot.devices, resume=str(resume), runs_dir=self.dir
                    )
                else:
                    prof, placement, resume_from = launch.prepare(
                        self.plan["sweep"]["profile"], devices=slot.devices,
                        overrides=trial["sets"], runs_dir=self.dir,
                        name=store.trial_name(n), exact_name=exact,
                    )  # fmt: skip
                launched = launch.start(prof, placement, self.dir, resume_from,
                                        exact_name=resume is None and exact)  # fmt: skip
        except (launch.LaunchError, ProfileError, RunDirError, OSError) as e:
            launch.release_resumes()
            self.free.append(slot)
            why = "; ".join(e.problems) if isinstance(e, ProfileError) else str(e)
            store.append_event(self.dir, "trial", trial=n, state="failed",
                               reason=f"could not start: {why}")  # fmt: skip
            if self.study is not None:
                with contextlib.suppress(Exception):  # a mirror: the sweep goes on without it
                    self.study.end(n, "failed", None)
            return
        step = int(resume_from.name.rsplit("-", 1)[-1]) if resume_from is not None else 0
        store.append_event(
            self.dir, "trial", trial=n, state="resumed" if resume is not None else "started",
            run=launched.run_dir.name, devices=slot.devices, step=step,
        )  # fmt: skip
        self.live[n] = (slot, launched.run_dir, launched.supervisor)

    def reap(self) -> None:
        for n, (_, run, proc) in list(self.live.items()):
            if proc is not None:
                proc.poll()  # a supervisor that exited is not left a zombie
            if not run.is_dir():  # deleted under the sweep: nothing will ever end it
                self.release(n)
                store.append_event(self.dir, "trial", trial=n, state="failed", run=run.name,
                                   reason="its run directory is gone")  # fmt: skip
                continue
            self.watch_evals(n, run)
            status = lost.settle(run)
            if not status.get("ended"):
                continue
            self.release(n)
            self.record_end(n, run, status)

    def release(self, n: int) -> None:
        """Trial ``n`` is no longer live: its slot is free again (the lowest taken first)."""
        slot, _, _ = self.live.pop(n)
        self.free.append(slot)
        self.free.sort(key=lambda s: s.index)

    def watch_evals(self, n: int, run: Path) -> None:
        """A live trial's new evals; the pruner's verdict on its newest."""
        tail = self.tails.setdefault(n, JsonlTail(run / "events.jsonl"))
        curve = self.evals.setdefault(n, {})
        for e in tail.read():
            before = len(curve)
            add_eval(curve, e, self.plan["objective"])
            if self.study is not None and len(curve) > before:
                self.study.report(n, max(curve), curve[max(curve)])
        if curve and n not in self.pruning and (why := self.prune_verdict(n, curve)):
            self.pruning[n] = why
            with contextlib.suppress(OSError):
                append_control(run, "stop")
            store.append_event(self.dir, "trial", trial=n, state="pruning", reason=why)

    def prune_verdict(self, n: int, curve: dict[int, float]) -> str:
        """Why trial ``n`` stops now (Optuna's median rule), or "": its value at its newest
        eval step worse than the median of the finished trials' at the same step."""
        rule = self.plan.get("pruning") or {}
        if rule.get("kind") != "median" or len(self.finished) < rule["startup_trials"]:
            return ""
        if len(curve) <= rule["warmup_evals"]:
            return ""
        step = max(curve)
        others = [self.evals[m][step] for m in self.finished if step in self.evals.get(m, {})]
        if not others:
            return ""
        middle = statistics.median(others)
        value = curve[step]
        if not better(self.plan["objective"]["direction"], middle, value):
            return ""
        metric = self.plan["objective"]["metric"]
        return (
            f"{metric} {value:.4g} at step {step}, worse than the median {middle:.4g} of "
            f"{len(others)} finished trial{'s' if len(others) > 1 else ''}"
        )

    def record_end(self, n: int, run: Path, status: dict[str, Any]) -> None:
        event = self._record_end(n, run, status)
        if self.study is not None and event["state"] != "stopped":
            try:
                self.study.end(n, event["state"], event.get("objective"))
            except Exception as e:  # the study is a mirror: the sweep goes on without it
                print(f"optuna: trial {n}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _record_end(self, n: int, run: Path, status: dict[str, Any]) -> dict[str, Any]:
        state = status.get("state")
        step = status.get("step")
        if n in self.pruning and state in RESUMABLE:
            return store.append_event(self.dir, "trial", trial=n, state="pruned", run=run.name,
                                      step=step, reason=self.pruning[n])  # fmt: skip
        if state == "finished":
            self.finished.add(n)
            self.evals[n] = eval_curve(run, self.plan["objective"])
            value = last(self.evals[n])
            return store.append_event(
                self.dir, "trial", trial=n, state="finished", run=run.name, objective=value,
                step=step, reason="" if value is not None else
                f"no {self.plan['objective']['metric']} in its eval events",
            )  # fmt: skip
        if state in RESUMABLE:
            return store.append_event(self.dir, "trial", trial=n, state="stopped", run=run.name,
                               step=step, reason=status.get("reason", ""))  # fmt: skip
        return store.append_event(self.dir, "trial", trial=n, state="failed", run=run.name,
                               step=step, reason=status.get("reason") or str(state))  # fmt: skip


def open_study(sweep_dir: Path, plan: dict[str, Any]) -> Study | None:
    """The sweep's Optuna study where Optuna is installed (a tpe search's sampler); a grid or
    random sweep whose study cannot be opened goes on without it, saying why."""
    if not study_available():
        return None
    try:
        return Study(sweep_dir, plan)
    except Exception as e:
        if plan["sweep"]["search"] == "tpe":
            raise
        print(f"optuna: the study is off: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None


def _used_seconds(events: list[dict[str, Any]]) -> float:
    """The time earlier drivers ran: each session's first event to its last."""
    spans: dict[str, list[float]] = {}
    session = None
    for e in events:
        if e.get("kind") == "sweep" and e.get("session"):
            session = e["session"]
        if session is not None and isinstance(e.get("t"), (int, float)):
            spans.setdefault(session, []).append(float(e["t"]))
    return sum(max(ts) - min(ts) for ts in spans.values())


@contextlib.contextmanager
def pinned(cores: tuple[int, ...]) -> Iterator[None]:
    """This process's CPU affinity set to ``cores`` while a CPU trial starts: its supervisor,
    torchrun and ranks inherit it (and size their threads by it)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "--lock-fd":
        print("usage: python -m gpu_console.sweep.driver SWEEP_DIR --lock-fd FD", file=sys.stderr)
        return 2
    sweep_dir = Path(argv[0])
    fd = int(argv[2])
    os.set_inheritable(fd, False)  # the trials' supervisors hold their own runs' locks
    session_lock.SessionLock(sweep_dir, fd).claim(os.getpid())
    driver = Driver(sweep_dir)

    def graceful(signum, _frame) -> None:
        driver.stop_asked = driver.stop_asked or f"signal {signal.Signals(signum).name}"

    signal.signal(signal.SIGTERM, graceful)
    signal.signal(signal.SIGINT, graceful)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        return driver.run()
    except Exception as e:  # the driver's own bug: the sweep says so, its trials go on
        import traceback

        traceback.print_exc()
        with contextlib.suppress(OSError):
            store.append_event(sweep_dir, "sweep", state="failed", session=driver.session,
                               reason=f"driver: crashed: {type(e).__name__}: {e}")  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
