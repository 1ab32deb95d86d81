"""One reader of a run (issue 14): the supervisor's status.json (what ``ls`` shows), the
headless console and the run screen fold the same events with the same rules (fold.py)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console

from gpu_console import headless
from gpu_console.commands.runs import list_runs
from gpu_console.state import RunFollower
from gpu_console.summary import summary_table
from gpu_console.supervisor import Supervisor
from gpu_console.tui.feed import RunFeed

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

NAN = float("nan")


def _append(run: Path, events: list[dict]) -> None:
    with open(run / "events.jsonl", "a", encoding="utf-8") as f:
        for e in events:
            f.write(json.dumps({"v": 1, **e}) + "\n")  # a NaN loss is written as NaN


def _step(t: float, step: int, loss: float, step_time_s: float = 0.1, mfu: float = 0.1) -> dict:
    return {"t": t, "kind": "step", "step": step, "loss": loss, "lr": 1e-3,
            "samples_per_s": 100.0, "step_time_s": step_time_s, "mfu": mfu}  # fmt: skip


def _start(t: float, start_step: int, restart: int) -> dict:
    return {"t": t, "kind": "start", "start_step": start_step, "restart": restart,
            "max_restarts": 1, "max_steps": 100, "world_size": 2, "device_type": "cpu",
            "precision": "fp32", "task": "mlp", "params": 10, "mfu_not_shown": None}  # fmt: skip


def _status(t: float, state: str, **fields) -> dict:
    return {"t": t, "kind": "status", "state": state, "reason": "", **fields}


def _meta(run: Path, sessions: list[dict]) -> None:
    (run / "meta.json").write_text(json.dumps({"id": run.name, "sessions": sessions}))


def _readers(run: Path, now: float) -> dict[str, dict]:
    """What each reader shows of the run: ls's row, the headless console, the run screen."""
    (row,) = list_runs(run.parent)
    follower = RunFollower(run)
    follower.poll()
    st = follower.state
    stalls = headless.Stalls(run, follower, Console(file=io.StringIO()))
    headless_state = "stalled" if stalls.check() else st.state
    feed = RunFeed(run, clock=lambda: now, telemetry=False)
    feed.load()
    snap = feed.snapshot()
    feed.close()
    summary = Console(record=True, width=200, file=io.StringIO())
    summary.print(summary_table(st, run))
    best_row = [ln for ln in summary.export_text().splitlines() if "best loss" in ln]
    return {
        "ls": {"state": row["state"], "step": row["step"], "loss": row["loss"],
               "best_loss": row["best_loss"], "restarts": row["restarts"]},
        "headless": {"state": headless_state, "step": st.step, "loss": st.loss,
                     "best_loss": st.best_loss, "restarts": st.restarts,
                     "summary_best": best_row[0].split()[-2]},
        "tui": {"state": snap.state, "step": snap.step, "loss": snap.loss,
                "best_loss": snap.best_loss, "restarts": snap.restarts},
    }  # fmt: skip


def test_ls_the_headless_console_and_the_run_screen_agree_on_one_event_stream(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("GPU_CONSOLE_STALL_S", raising=False)  # the 30 s floor
    now = time.time()
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "run.toml").write_text("[distributed]\nshutdown_grace_s = 3.0\n")

    # Session 1: a NaN first loss, a crash that torchrun restarts from step 20, a stop at 33.
    t = now - 1000
    _meta(run, [{"started": t - 1, "events_from": 0}])
    sup = Supervisor(run)
    _append(run, [
        _status(t, "starting"), _start(t, 0, 0), _status(t, "running"),
        _step(t + 1, 10, NAN), _step(t + 2, 20, 1.5),
        {"t": t + 3, "kind": "checkpoint", "step": 20, "reason": "interval", "path": "c/20"},
        _status(t + 4, "restarting", step=23, reason="RuntimeError: boom"),
        _start(t + 5, 20, 1), _status(t + 5, "running"), _step(t + 6, 30, 1.8),
        {"t": t + 7, "kind": "checkpoint", "step": 33, "reason": "stop", "path": "c/33"},
        _status(t + 7, "stopped", step=33, reason="stop", checkpointed=True),
    ])  # fmt: skip
    sup.fold_events()
    assert sup.finish(0) == 0
    first = _readers(run, now)
    expected = {"state": "stopped", "step": 33, "loss": 1.8, "best_loss": 1.5, "restarts": 1}
    for name, seen in first.items():
        assert {k: seen[k] for k in expected} == expected, name
    assert first["headless"]["summary_best"] == "1.5000"

    # Session 2, resumed in place (as launch.continue_run leaves it): a NaN again, then steps
    # of 0.1 s but the last of 10 s, and nothing for 60 s since. The stall limit is 10 × the
    # median step time (floor 30 s) for every reader: stalled, not 10 × the last (100 s).
    (run / "history").mkdir()
    shutil.copy2(run / "status.json", run / "history" / "status-1.json")
    size = (run / "events.jsonl").stat().st_size
    t = now - 300
    _meta(run, [{"started": now - 1001, "events_from": 0}, {"started": t, "events_from": size}])
    os.unlink(run / "status.json")
    sup = Supervisor(run)
    sup.status["started"] = t  # this supervisor began 300 s ago
    _append(run, [
        _status(t + 1, "starting"), _start(t + 1, 33, 0), _status(t + 1, "running"),
        _step(t + 2, 40, NAN, mfu=0.5), _step(t + 3, 50, 1.7, mfu=0.5),
        _step(now - 100, 60, 1.6, mfu=0.5), _step(now - 60, 70, 1.65, 10.0, mfu=0.5),
    ])  # fmt: skip
    sup.fold_events()
    sup.write_status(force=True)
    second = _readers(run, now)
    # The best loss is the whole run's (the supervisor carries session 1's from its status).
    expected = {"state": "stalled", "step": 70, "loss": 1.65, "best_loss": 1.5, "restarts": 0}
    for name, seen in second.items():
        assert {k: seen[k] for k in expected} == expected, name
    assert second["headless"]["summary_best"] == "1.5000"
    # The mean MFU is this session's (a resume may run on other hardware), in ls and summary.
    follower = RunFollower(run)
    follower.poll()
    (row,) = list_runs(tmp_path)
    assert row["mfu"] == pytest.approx(0.5) == follower.state.mean_mfu()
    assert not math.isnan(json.loads((run / "status.json").read_text())["best_loss"])


def test_the_fold_keeps_session_means_across_a_restart_and_starts_them_again_on_a_resume():
    from gpu_console.fold import RunFold

    fold = RunFold()
    for e in [
        _start(1.0, 0, 0), _step(2.0, 10, math.inf, mfu=0.2), _step(3.0, 20, 2.0, mfu=0.4),
        _start(4.0, 20, 1), _step(5.0, 30, -math.inf, mfu=0.6),  # torchrun's restart
    ]:  # fmt: skip
        fold.apply(e)
    assert fold.best_loss == 2.0, "an infinity is never the best loss"
    assert fold.mean_mfu() == pytest.approx(0.4) and fold.restarts == 1
    assert fold.last_step_t == 5.0 and fold.step_time_s == 0.1
    fold.apply(_start(6.0, 30, 0))  # a resume: a new session, no step made yet
    assert fold.mean_mfu() is None and fold.restarts == 0
    assert fold.last_step_t is None and fold.step_time_s is None, "no stall before a step"
    assert (fold.step, fold.best_loss) == (30, 2.0)
