"""A stall is judged per step, from the ranks' heartbeats, whatever the log interval; a pause
and the moment after it are never a stall (issue 42, point 8).

The decision (``stall.py``) on synthetic heartbeats and status fields, and the heartbeat's
own record of progress on a fake clock; ``test_stall_real_run.py`` runs the engine.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from gpu_console import stall
from gpu_console.fold import RunFold, derived_state, shown_state
from gpu_console.heartbeats import read_heartbeats

pytestmark = pytest.mark.quick

NOW = 10_000.0
ME = {"pid": os.getpid(), "host": socket.gethostname()}


def live(**fields) -> dict:
    """status.json of a running run whose supervisor lives (this process)."""
    return {"state": "running", "pids": {"supervisor": os.getpid()}, "started": NOW - 3600,
            **fields}  # fmt: skip


def beat(rank, step, moved, step_s, phase="compute", t=NOW - 0.5, since=None) -> dict:
    """A rank's heartbeat record: at ``step`` in ``phase``, last advanced at ``moved``."""
    since = moved if since is None else since
    return {"rank": rank, **ME, "step": step, "phase": phase, "detail": "", "t": t,
            "since": since, "moved": moved, "step_s": step_s}  # fmt: skip


@pytest.fixture(autouse=True)
def floor(monkeypatch):
    monkeypatch.delenv("GPU_CONSOLE_STALL_S", raising=False)  # the 30 s floor


# -- the decision -----------------------------------------------------------------------------


def test_fast_steps_logged_every_50_are_never_stalled():
    # 0.1 s steps, a step event every 50 (5 s): the last one long past any per-event limit
    # the old rule had (10 × 0.1 s, floored at 30 s); the heartbeats moved a moment ago.
    status = live(last_step_t=NOW - 45, step_time_s=0.1, log_steps=50)
    beats = [beat(0, 9_849, NOW - 0.05, 0.1), beat(1, 9_849, NOW - 0.04, 0.1)]
    assert not stall.no_progress(status, NOW, 0.1, beats)
    # Per step: 10 × 0.1 s is under the floor, so the floor decides.
    assert not stall.no_progress(status, NOW + 29, 0.1, beats)
    assert stall.no_progress(status, NOW + 31, 0.1, beats)


def test_an_eval_batch_is_judged_by_the_eval_batches_pace_not_a_steps():
    # 0.1 s steps, 20 s eval batches (a batch that samples many tours of each instance).
    status = live(last_step_t=NOW - 300, step_time_s=0.1)
    progress = {"step": 500, "done": 3, "total": 8, "t": NOW - 100}
    status["eval_progress"] = progress
    beats = [{**beat(r, 500, NOW - 100, 0.1, phase="eval"), "eval_s": 20.0} for r in (0, 1)]
    assert not stall.no_progress(status, NOW, 0.1, beats)  # 100 s of a 20 s batch: 10× is 200
    assert stall.no_progress(status, NOW + 101, 0.1, beats)
    # Back to training, the step's pace judges again.
    training = [beat(r, 501, NOW - 100, 0.1) for r in (0, 1)]
    assert stall.no_progress({**status, "eval_progress": None}, NOW, 0.1, training)


def test_the_runs_first_eval_batch_is_judged_as_a_first_step_is(tmp_path):
    """Nobody knows its time yet: however long it takes, only a frozen heartbeat is a stall
    (a rank's heartbeat thread goes on beating while the batch computes)."""
    now = time.time()
    status = live(last_step_t=now - 900, step_time_s=0.1, started=now - 3600)
    status["eval_progress"] = {"step": 500, "done": 0, "total": 8, "t": now - 600}
    beats = [beat(r, 500, now - 600, 0.1, phase="eval", t=now - 0.5) for r in (0, 1)]
    assert not stall.no_progress(status, now, 0.1, beats)
    _write_beats(tmp_path, beats)
    assert not stall.stalled("running", status, now, 0.1, run_dir=tmp_path)
    _write_beats(tmp_path, [{**beats[0], "t": now - 60}, beats[1]])  # rank 0's thread silent
    assert stall.stalled("running", status, now, 0.1, run_dir=tmp_path)
    # An eval at the run's start: no step measured either.
    at_start = live(eval_progress={"step": 0, "done": 0, "total": 8, "t": NOW - 600})
    first = [beat(r, 0, NOW - 600, None, phase="eval") for r in (0, 1)]
    assert not stall.no_progress(at_start, NOW, None, first)


def test_ranks_that_stop_advancing_are_stalled_after_the_limit():
    status = live(last_step_t=NOW - 200, step_time_s=6.0)
    # 6 s steps: the limit is 10 × 6 s = 60 s after the last advance, not the 30 s floor.
    beats = [beat(0, 120, NOW - 59, 6.0), beat(1, 120, NOW - 59, 5.5)]
    assert not stall.no_progress(status, NOW, 6.0, beats)
    assert stall.no_progress(status, NOW + 2, 6.0, beats)
    # The heartbeats' pace alone, before any step event measured one (log every 50 steps).
    early = live(running_since=NOW - 300)
    assert not stall.no_progress(early, NOW, None, beats)
    assert stall.no_progress(early, NOW + 2, None, beats)


def test_the_slower_of_the_heartbeats_and_the_events_pace_sets_the_limit():
    beats = [beat(0, 50, NOW - 100, 2.0)]
    assert stall.no_progress(live(), NOW, 2.0, beats)  # 100 s > 10 × 2 s
    assert not stall.no_progress(live(), NOW, 12.0, beats)  # the events say 12 s a step


def test_a_pause_of_minutes_is_not_stalled_nor_the_moment_after_it():
    # Paused at step 300, ten minutes ago: the status says so, and so does every heartbeat.
    paused = live(state="paused", last_step_t=NOW - 600, running_since=NOW - 900)
    beats = [beat(r, 300, NOW - 600, 0.2, phase="paused", since=NOW - 0.2) for r in (0, 1)]
    assert derived_state(paused, NOW) == "paused"
    # Resumed: the status is running a moment before the ranks' heartbeats say so.
    resumed = {**paused, "state": "running", "running_since": NOW - 0.5}
    assert not stall.no_progress(resumed, NOW, 0.2, beats)
    # The resume's status event alone is a sign of life (no heartbeat to read: elsewhere).
    assert not stall.no_progress(resumed, NOW, 0.2, None)
    # Then the first step after it: the pause's ten minutes are no step's.
    moving = [beat(r, 301, NOW - 0.1, 0.2) for r in (0, 1)]
    assert not stall.no_progress(resumed, NOW, 0.2, moving)
    # And a run resumed that never steps again is a stall, a limit after the resume.
    assert stall.no_progress(resumed, NOW + 31, 0.2, moving)


def test_a_rank_stuck_in_its_paused_turn_is_not_kept_from_a_stall():
    beats = [beat(0, 300, NOW - 600, 0.2, phase="paused", since=NOW - 40)]
    resumed = live(last_step_t=NOW - 600, running_since=NOW - 40)
    assert stall.no_progress(resumed, NOW, 0.2, beats)


def test_without_heartbeats_the_events_limit_is_a_log_interval():
    # A reader that cannot see the heartbeats: 50 steps of 2 s between step events.
    status = live(last_step_t=NOW - 90, step_time_s=2.0, log_steps=50)
    assert not stall.no_progress(status, NOW, 2.0, None)  # 90 s < 10 × 100 s
    assert stall.no_progress(status, NOW + 920, 2.0, None)


def test_every_view_takes_the_fold_ahead_of_status_json():
    # status.json still says running (the supervisor's tick), the events say paused.
    fold = RunFold()
    fold.apply({"kind": "status", "state": "running", "t": NOW - 700})
    fold.apply({"kind": "step", "step": 300, "step_time_s": 0.2, "t": NOW - 600})
    fold.apply({"kind": "status", "state": "paused", "t": NOW - 599})
    status = {**live(), **fold.to_status(), "state": "running"}
    assert derived_state(status, NOW) == "stalled"  # what status.json alone would say
    assert shown_state(fold, status, NOW) == "paused"
    # Resumed a moment ago: the fold knows, status.json does not yet.
    fold.apply({"kind": "status", "state": "running", "reason": "resumed", "t": NOW - 1})
    assert shown_state(fold, {**status, "state": "paused"}, NOW) == "running"


def test_the_fold_keeps_the_log_interval_and_when_running_began():
    fold = RunFold()
    fold.apply({"kind": "start", "start_step": 0, "t": 1.0})
    fold.apply({"kind": "status", "state": "running", "t": 2.0})
    fold.apply({"kind": "step", "step": 50, "t": 3.0})
    fold.apply({"kind": "checkpoint", "step": 75, "t": 4.0})  # a step between step events
    fold.apply({"kind": "step", "step": 100, "t": 5.0})
    fold.apply({"kind": "status", "state": "paused", "t": 6.0})
    fold.apply({"kind": "status", "state": "running", "reason": "resumed", "t": 9.0})
    out = fold.to_status()
    assert (out["log_steps"], out["running_since"]) == (50, 9.0)


def test_a_resumed_session_judges_by_the_runs_log_interval_before_it_measures_its_own():
    """The supervisor of a resumed session folds only its own events: until its second step
    event, the log interval is the run's, from the last status.json (carry)."""
    fold = RunFold()
    fold.carry({"step": 300, "loss": 0.5, "log_steps": 50}, resume_step=300)
    fold.apply({"kind": "start", "start_step": 300, "t": NOW - 120})
    fold.apply({"kind": "status", "state": "running", "t": NOW - 110})
    fold.apply({"kind": "step", "step": 350, "step_time_s": 1.0, "t": NOW - 100})
    status = {**live(), **fold.to_status(), "state": "running"}
    assert status["log_steps"] == 50
    assert derived_state(status, NOW) == "running"  # 100 s quiet < 10 × 50 steps × 1 s
    fold.apply({"kind": "step", "step": 360, "step_time_s": 1.0, "t": NOW - 90})
    assert fold.to_status()["log_steps"] == 10  # its own interval, once it has two


# -- the heartbeat's record ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def time(self) -> float:
        return self.t


def test_the_heartbeat_says_when_the_rank_moved_and_its_pace_without_pauses(tmp_path, monkeypatch):
    from gpu_console.engine import heartbeat as hb_module

    clock = Clock()
    monkeypatch.setattr(hb_module, "time", clock)
    hb = hb_module.Heartbeat(tmp_path, rank=0, local_rank=0, restart=0)
    try:

        def step(n: int, took: float) -> None:
            hb.set(n, "data")
            hb.set(n, "compute")
            clock.t += took
            hb.set(n, "update")

        step(1, 30.0)  # the first step (a compile): not the rank's pace
        assert hb.step_s is None and hb.moved == 1000.0
        for n in range(2, 6):
            step(n, 0.5)
        assert hb.step_s == pytest.approx(0.5)  # steps 2..4, start to start
        hb.set(5, "paused")
        clock.t += 600.0  # a ten-minute pause
        hb.set(5, "paused")
        moved = hb.moved
        step(6, 0.5)  # the gap from step 5's start to step 6's holds the pause: not measured
        assert hb.step_s == pytest.approx(0.5) and hb.moved > moved
        hb.set(6, "eval", "1/4")
        clock.t += 3.0
        hb.set(6, "eval", "2/4")  # an eval batch is progress too
        assert hb.moved == clock.t
        step(7, 0.5)
        step(8, 0.5)
        assert hb.step_s == pytest.approx(0.5)  # the eval's gap was left out too
        hb._write()
        (record,) = read_heartbeats(tmp_path)
        assert record["moved"] == pytest.approx(hb.moved) and record["step_s"] == 0.5
    finally:
        hb.close("done")


def test_the_heartbeat_times_each_evals_batches_on_their_own(tmp_path, monkeypatch):
    from gpu_console.engine import heartbeat as hb_module

    clock = Clock()
    monkeypatch.setattr(hb_module, "time", clock)
    hb = hb_module.Heartbeat(tmp_path, rank=0, local_rank=0, restart=0)
    try:
        hb.set(4, "update")
        clock.t += 100.0  # whatever came before the eval is not a batch's time
        hb.set(4, "eval")
        hb.set(4, "eval", "0/3")
        assert hb.eval_s is None  # the first batch has only begun
        clock.t += 4.0
        hb.set(4, "eval", "1/3")
        assert hb.eval_s == pytest.approx(4.0) and hb.moved == clock.t
        clock.t += 6.0
        hb.set(4, "eval", "2/3")
        assert hb.eval_s == pytest.approx(4.0 + hb_module.STEP_S_WEIGHT * (6.0 - 4.0))
        hb._write()
        (record,) = read_heartbeats(tmp_path)
        assert record["eval_s"] == pytest.approx(hb.eval_s)
        clock.t += 4.0
        hb.set(5, "data")  # training again: the last batch's time is not measured
        clock.t += 500.0
        # The next eval (the cvrp task's end eval samples forty times more): not judged by
        # this one's batches, its first batch untimed, the next timed on their own.
        hb.set(9, "eval")
        hb.set(9, "eval", "0/2")
        assert hb.eval_s is None
        clock.t += 240.0
        hb.set(9, "eval", "1/2")
        assert hb.eval_s == pytest.approx(240.0)
        # A second split times its own batches too.
        clock.t += 240.0
        hb.set(9, "eval", "train_est 0/4")
        assert hb.eval_s is None
        clock.t += 1.0
        hb.set(9, "eval", "train_est 1/4")
        assert hb.eval_s == pytest.approx(1.0)
    finally:
        hb.close("done")


def test_the_heartbeat_record_with_its_new_fields_fits_its_fixed_size(tmp_path):
    from gpu_console.engine.heartbeat import RECORD_BYTES, Heartbeat

    hb = Heartbeat(tmp_path, rank=12345, local_rank=7, restart=99)
    try:
        hb._host = "h" * 64  # the longest host name
        hb.moved, hb.step_s, hb.eval_s = time.time(), 1234.5678, 12345.6789
        hb.set(2**40, "checkpoint", "train_est 12345678/12345678")
        assert len(hb._record()) == RECORD_BYTES
        assert hb._record().rstrip().endswith(b"}")  # whole, not cut
    finally:
        hb.close("done")


def _write_beats(run, beats: list[dict]) -> None:
    folder = run / "heartbeats"
    folder.mkdir(parents=True, exist_ok=True)
    for b in beats:
        (folder / f"rank-{b['rank']:05d}.json").write_text(json.dumps(b))


def test_ls_reads_the_heartbeat_files_and_says_how_long_the_run_was_quiet(tmp_path):
    now = time.time()
    # A step event 45 s ago (50 steps between them), the ranks advanced 0.2 s ago.
    status = {**live(last_step_t=now - 45, step_time_s=0.1, log_steps=50), "started": now - 600}
    _write_beats(tmp_path, [beat(r, 9_849, now - 0.2, 0.1, t=now - 0.3) for r in (0, 1)])
    assert derived_state(status, now, run_dir=tmp_path) == "running"
    assert stall.quiet_s(status, now, tmp_path) == pytest.approx(0.2, abs=0.01)
    assert stall.quiet_s(status, now) == pytest.approx(45, abs=0.01)  # the events alone
    # The ranks stopped advancing 40 s ago, their threads still beating: stalled, and the
    # consoles' "no step for N s" counts from the ranks' last advance, not the step event.
    _write_beats(tmp_path, [beat(r, 9_860, now - 40, 0.1, t=now - 0.3) for r in (0, 1)])
    assert derived_state(status, now, run_dir=tmp_path) == "stalled"
    assert stall.quiet_s(status, now, tmp_path) == pytest.approx(40, abs=0.01)
    # An earlier session's records (older than this session's start) are not this run's.
    assert stall.quiet_s({**status, "started": now}, now, tmp_path) == pytest.approx(45, abs=0.01)
