"""A real run's own heartbeats and events, judged as every view judges them, through a log
interval twice the stall limit, a pause longer than it and the resume up to the first step
event after it: never ``stalled`` (issue 42, point 8). One run of two ranks in the engine
harness: a stall is "no rank advanced", and a pause is the ranks' agreement.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

from conftest import deadline, events_of, paced_profile, read_events, wait_for
from harness import run_engine

from gpu_console.events import append_control
from gpu_console.fold import RunFold, derived_state, shown_state
from gpu_console.heartbeats import read_heartbeats


def test_a_long_log_interval_and_a_pause_are_never_stalled_in_a_real_run(tmp_path, monkeypatch):
    """Judged every 50 ms as ``ls`` judges (status.json's fields, the heartbeat files) and as
    the consoles do (their own fold ahead of status.json), from the first measured step to
    the first step event after the resume."""
    # A floor the paced ranks never come near on a busy machine (the product's is 30 s; the
    # heartbeats that show progress between log steps are written every second), and short
    # enough that a log interval of twice it and a pause past it keep the test short.
    limit = deadline(3.0)
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", f"{limit:.2f}")
    pace = 0.02
    log_every = math.ceil(2 * limit / pace)  # a log interval of at least twice the limit
    profile = paced_profile(tmp_path, max_steps=1_000_000, ranks=2)
    runs = tmp_path / "runs"
    verdicts: list[tuple[str, str, str]] = []  # (what the run was doing, ls's, the consoles')
    errors: list[BaseException] = []
    doing = ["starting"]

    def judge(run: Path) -> None:
        fold = RunFold()
        for e in read_events(run):
            fold.apply(e)
        # status.json as the supervisor would write it from the same events.
        status = {"pids": {"supervisor": os.getpid()}, "started": fold.start.get("t")}
        status.update(fold.to_status())
        now = time.time()
        ls = derived_state(status, now, run_dir=run)
        verdicts.append((doing[0], ls, shown_state(fold, status, now, run_dir=run)))

    def drive() -> None:
        try:
            run = wait_for(lambda: next(runs.glob("*/events.jsonl"), None), what="the run").parent
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.05):
                    judge(run)

            watcher = threading.Thread(target=watch, daemon=True)
            wait_for(lambda: _stepping(run), what="the heartbeats past the first steps")
            watcher.start()
            doing[0] = "a log interval"
            first = wait_for(lambda: _steps(run), what="the first step event")
            wait_for(lambda: _steps(run) > first, what="a whole log interval")
            doing[0] = "paused"
            asked = time.time()
            append_control(run, "pause")
            wait_for(lambda: _state(run) == "paused", what="paused")
            wait_for(lambda: time.time() > asked + 1.5 * limit, what="a pause past the limit")
            doing[0] = "resumed"
            steps = _steps(run)
            append_control(run, "resume")
            wait_for(lambda: _steps(run) > steps, what="the first step event after the resume")
            done.set()
            watcher.join()
        except BaseException as e:  # noqa: BLE001 - raised in the test, below
            errors.append(e)
        finally:
            for events in runs.glob("*/events.jsonl"):
                append_control(events.parent, "stop")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    run = run_engine(tmp_path, profile, f"train.log_every={log_every}", runs_dir=runs,
                     ranks=2, env={"PACE_S": str(pace)})  # fmt: skip
    driver.join()
    if errors:
        raise errors[0]
    stalled = [v for v in verdicts if "stalled" in v]
    assert not stalled, stalled[:3]
    assert {"a log interval", "paused", "resumed"} <= {v[0] for v in verdicts}
    assert ("paused", "paused", "paused") in verdicts
    assert events_of(run, "status")[-1]["state"] == "stopped"


def _steps(run: Path) -> int:
    return len(events_of(run, "step"))


def _state(run: Path) -> str | None:
    statuses = events_of(run, "status")
    return statuses[-1]["state"] if statuses else None


def _stepping(run: Path) -> bool:
    beats = read_heartbeats(run)
    return bool(beats) and all(b.get("step", 0) >= 3 for b in beats)
