"""Stop and resume through the real CLI: one training run stays one run directory.

``--resume RUN`` continues in RUN's own directory, wherever the command runs from: one entry
in ``ls``, one events.jsonl (a new ``start`` per session), checkpoints continuing in the same
``checkpoints/``. Nothing of a previous session (its stop command, its status, its failure,
its logs, its heartbeats) is taken for the new one's. The step a run reports is its true
last step, logged or not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
from conftest import (
    Procs,
    deadline,
    events_of,
    fast_profile,
    pid_alive,
    pinned_env,
    read_status,
    run_dirs,
    task_profile,
    the_run,
    wait_for,
)

from gpu_console.state import read_heartbeats


def _acks(run, cid):
    return [e["state"] for e in events_of(run, "control") if e.get("id") == cid]


def _beat_step(run) -> int:
    return max((b.get("step") or 0 for b in read_heartbeats(run)), default=0)


def _ls(procs, runs_dir, cwd):
    result = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _snapshot(run):
    """Every file of a run directory with its bytes: what a refused command must not touch."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and "heartbeats" not in p.parts and p.name != "telemetry.jsonl"
    }


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run (one CPU rank) stopped by ``gpu-console stop`` between two log steps, through the
    real CLI; launched from a directory of its own (``launched_in``, left empty) with an exact
    name, so a test can resume a copy of it by a relative path from elsewhere. Read it, never
    change it: copy it first."""
    tmp = tmp_path_factory.mktemp("stopped")
    runs_dir, launched_in = tmp / "runs", tmp / "launched-in"
    launched_in.mkdir()
    profile = fast_profile(tmp, max_steps=1_000_000)
    procs = Procs(runs_dir)
    try:
        # No step event before the stop: only the checkpoint and the final status know the step.
        console = procs.start(
            "run", str(profile), "--headless", "--runs-dir", str(runs_dir),
            "--set", "train.log_every=100000", "--name", "rel", "--exact-name",
            cwd=launched_in, env=pinned_env(),
        )  # fmt: skip
        run = wait_for(lambda: the_run(runs_dir), what="the run directory")
        wait_for(lambda: _beat_step(run) >= 20, what="20 steps (heartbeats)")
        stop = procs.cli("stop", str(run), "--runs-dir", str(runs_dir), env=pinned_env())
        out, err = console.communicate(timeout=deadline(120))
        yield SimpleNamespace(
            run=run, runs_dir=runs_dir, tmp=tmp, launched_in=launched_in, stop=stop,
            console=console, out=out, err=err,
        )  # fmt: skip
    finally:
        procs.cleanup()


def test_a_stop_between_log_steps_reports_the_checkpoints_step(procs, stopped):
    run, runs_dir, out = stopped.run, stopped.runs_dir, stopped.out
    assert stopped.stop.returncode == 0, stopped.stop.stderr
    assert stopped.console.returncode == 0, out + stopped.err

    assert events_of(run, "step") == []
    (ckpt,) = [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"]
    step = ckpt["step"]
    assert step >= 20
    final = events_of(run, "status")[-1]
    assert final["state"] == "stopped" and final["step"] == step
    assert read_status(run)["step"] == step
    (row,) = _ls(procs, runs_dir, stopped.tmp)
    assert row["step"] == step and row["state"] == "stopped"
    assert f"{step}/1000000" in out, out


def test_resume_continues_in_the_same_directory_from_anywhere(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=1_000_000, ranks=2)
    # Launched from tmp_path without --runs-dir: the run lives in tmp_path/runs (runs_dir).
    console = procs.start("run", str(profile), "--headless", cwd=tmp_path)
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 5, what="5 steps")
    wait_for(lambda: len(read_heartbeats(run)) == 2, what="both ranks' heartbeats")
    # status.json follows the events on the supervisor's next tick: the refusal names it.
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json: running")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    # A live run is not resumed, and nothing of it is touched.
    before = _snapshot(run)
    live = procs.cli("run", "--resume", str(run), "--headless", cwd=elsewhere)
    assert live.returncode == 2, live.stdout + live.stderr
    assert live.stderr.splitlines() == [
        f"gpu-console: --resume: {run}: another session is continuing it now (state running); "
        f"watch it with gpu-console attach {run}"
    ], live.stderr
    assert "Traceback" not in live.stderr
    assert (run / "run.toml").read_bytes() == before["run.toml"]
    assert (run / "meta.json").read_bytes() == before["meta.json"]
    assert not (run / "history").exists() and list(elsewhere.iterdir()) == []

    stop = procs.cli("stop", run.name, cwd=tmp_path)
    assert stop.returncode == 0, stop.stderr
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    (stop_id,) = {e["id"] for e in events_of(run, "control") if e["cmd"] == "stop"}
    (ckpt,) = [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"]
    stopped_at = ckpt["step"]
    first_toml = (run / "run.toml").read_text()
    first_meta = json.loads((run / "meta.json").read_text())

    # Resumed from another directory, without --runs-dir, on one rank instead of two.
    resumed = procs.cli(
        "run", "--resume", str(run), "--headless", "--devices", "cpu:1",
        "--set", f"train.max_steps={stopped_at + 20}",
        cwd=elsewhere,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert list(elsewhere.iterdir()) == [], "the resumed run went under the current directory"
    assert run_dirs(runs_dir) == [run]
    (row,) = _ls(procs, runs_dir, tmp_path)
    assert row["name"] == run.name and row["state"] == "finished"
    assert row["step"] == stopped_at + 20

    # One history: two starts, the old stop not redone, steps continuing past the stop.
    starts = events_of(run, "start")
    assert len(starts) == 2
    assert starts[1]["start_step"] == stopped_at and starts[1]["world_size"] == 1
    assert starts[1]["resumed_from"].endswith(f"step-{stopped_at:08d}")
    assert _acks(run, stop_id) == ["received", "done"]
    steps = [e["step"] for e in events_of(run, "step")]
    assert steps[-20:] == list(range(stopped_at + 1, stopped_at + 21))
    assert max(steps) == stopped_at + 20
    status = read_status(run)
    assert status["state"] == "finished" and status["exit_code"] == 0
    assert status["step"] == stopped_at + 20 and "failure" not in status
    assert (run / "checkpoints" / "LATEST").read_text().strip() == (f"step-{stopped_at + 20:08d}")
    assert (run / "checkpoints" / f"step-{stopped_at:08d}" / "meta.json").is_file()
    # The summary is the whole run's: its checkpoint is the new one.
    assert f"step {stopped_at + 20}, end" in resumed.stdout, resumed.stdout

    # Nothing of the first session is lost, nor taken for the second's.
    assert (run / "history" / "run-1.toml").read_text() == first_toml
    assert f"max_steps = {stopped_at + 20}" in (run / "run.toml").read_text()
    assert json.loads((run / "history" / "status-1.json").read_text())["state"] == "stopped"
    assert (run / "logs" / "session-1" / "torchrun.log").is_file()
    assert (run / "logs" / "session-1" / "supervisor.log").is_file()
    assert (run / "logs" / "torchrun.log").is_file()
    assert sorted(b["rank"] for b in read_heartbeats(run)) == [0]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["id"] == first_meta["id"] and meta["command"] == first_meta["command"]
    assert meta["created"] == first_meta["created"] and meta["resume_from"] is None
    assert len(meta["sessions"]) == 2
    second = meta["sessions"][1]
    assert "--resume" in second["command"]
    assert second["resume_from"].endswith(f"step-{stopped_at:08d}")
    assert second["world_size"] == 1 and second["torchrun"][-1] == str(run)
    assert second["cwd"] == str(tmp_path)  # where the run was launched: its tasks are there

    # A finished run is not resumed without a larger train.max_steps; nothing is written.
    before = _snapshot(run)
    again = procs.cli("run", "--resume", run.name, "--headless", cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    (line,) = again.stderr.splitlines()
    # Found by name under ./runs: named as found.
    assert line == (
        f"gpu-console: --resume: runs/{run.name}: already at max_steps {stopped_at + 20}; "
        "raise train.max_steps to continue (--set train.max_steps=N)"
    ), line
    # --name would rename the run: refused.
    renamed = procs.cli(
        "run", "--resume", run.name, "--headless", "--name", "other",
        "--set", f"train.max_steps={stopped_at + 40}",
        cwd=tmp_path,
    )  # fmt: skip
    assert renamed.returncode == 2, renamed.stdout + renamed.stderr
    (line,) = renamed.stderr.splitlines()
    assert line.startswith("gpu-console: --name: a resumed run continues in its own"), line
    assert _snapshot(run) == before


# Rank 1 fails in its CRASH_AT-th batch, once (a flag file): with RuntimeError(CRASH_MSG), or
# killed by SIGKILL when CRASH_KILL is set. Every step sleeps PACE_S.
CRASHING_TASK = """
import os
import signal
import time
from gpu_console.tasks.mlp import MLPTask


class Crashing(MLPTask):
    calls = 0

    def compute(self, model, batch):
        Crashing.calls += 1
        time.sleep(float(os.environ.get("PACE_S", "0")))
        flag = os.environ.get("CRASH_ONCE")
        at = int(os.environ.get("CRASH_AT", "0"))
        if flag and os.environ["RANK"] == "1" and Crashing.calls == at:
            if not os.path.exists(flag):
                open(flag, "w").close()
                if os.environ.get("CRASH_KILL"):
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(os.environ["CRASH_MSG"])
        return super().compute(model, batch)
"""


def test_sessions_failures_are_their_own(procs, runs_dir, tmp_path):
    """A failed session, then a clean stop, then a rank killed: each is reported as itself."""
    profile = task_profile(
        tmp_path, "crashing", CRASHING_TASK, "Crashing", max_steps=1_000_000,
        extra="[checkpoint]\nevery_steps = 4\n",
        ranks=2,
    )  # fmt: skip
    rd = ("--runs-dir", str(runs_dir))

    first = procs.cli(
        "run", str(profile), "--headless", *rd, cwd=tmp_path,
        env=conftest.test_env(CRASH_ONCE=str(tmp_path / "flag-1"), CRASH_AT="10",
                     CRASH_MSG="first session boom"),
    )  # fmt: skip
    assert first.returncode == 1, first.stdout + first.stderr
    run = the_run(runs_dir)
    status = read_status(run)
    assert status["state"] == "failed" and "first session boom" in status["failure"]["summary"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000008"

    # Session 2: resumed, then stopped cleanly; the first session's failure is history.
    console = procs.start(
        "run", "--resume", str(run), "--headless", *rd, cwd=tmp_path,
        env=conftest.test_env(PACE_S="0.02"),
    )  # fmt: skip
    wait_for(lambda: len(events_of(run, "start")) == 2, what="the second session's start")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    wait_for(lambda: events_of(run, "step")[-1]["step"] >= 12, what="steps past the resume")
    assert procs.cli("stop", str(run), *rd).returncode == 0
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    status = read_status(run)
    assert status["state"] == "stopped" and status["exit_code"] == 0, status
    assert "failure" not in status and status["reason"] == "stop"
    assert "boom" not in out, out  # the first session's failure is not news
    (row,) = _ls(procs, runs_dir, tmp_path)
    assert row["state"] == "stopped" and "boom" not in row["reason"]

    # Session 3: rank 1 is killed outright (no error file): that is its failure, not the
    # first session's RuntimeError, whose error file and torchrun lines are in session-1.
    third = procs.cli(
        "run", "--resume", str(run), "--headless", *rd, cwd=tmp_path,
        env=conftest.test_env(CRASH_ONCE=str(tmp_path / "flag-3"), CRASH_AT="3", CRASH_KILL="1"),
    )  # fmt: skip
    assert third.returncode == 1, third.stdout + third.stderr
    status = read_status(run)
    assert status["state"] == "failed", status
    assert "boom" not in json.dumps(status["failure"]), status["failure"]
    # Rank 0's shared-memory reduce names the rank that ended under it.
    assert "rank 1" in status["failure"]["summary"], status["failure"]
    assert (run / "logs" / "session-1").is_dir() and (run / "logs" / "session-2").is_dir()
    assert len(json.loads((run / "meta.json").read_text())["sessions"]) == 3
    earlier = [json.loads((run / "history" / f"status-{n}.json").read_text()) for n in (1, 2)]
    assert [s["state"] for s in earlier] == ["failed", "stopped"]
    for key in ("supervisor", "torchrun"):
        assert not pid_alive(status["pids"][key])


def test_resume_refuses_a_run_whose_supervisor_is_alive(procs, runs_dir, tmp_path):
    """Status says stopped but its supervisor's pid is alive: refused, nothing written."""
    # Outside runs_dir: the teardown kills the pids of the runs under runs_dir.
    run = tmp_path / "elsewhere" / "live-20260101-000000"
    ckpt = run / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (run / "run.toml").write_text(fast_profile(tmp_path).read_text())
    (ckpt / "meta.json").write_text('{"step": 4}')
    (ckpt / "state.pt").write_bytes(b"")
    (run / "checkpoints" / "LATEST").write_text("step-00000004\n")
    # The stand-in for a supervisor still at work: this test's own process.
    (run / "status.json").write_text(
        json.dumps({"state": "stopped", "pids": {"supervisor": os.getpid()}})
    )
    before = _snapshot(run)
    result = procs.cli("run", "--resume", str(run), "--headless", "--runs-dir", str(runs_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (
        f"gpu-console: --resume: {run}: the run is still live (state stopped); "
        f"stop it first (gpu-console stop {run})"
    )
    assert _snapshot(run) == before and not runs_dir.exists()


def test_a_reader_acts_only_on_its_sessions_new_commands(tmp_path):
    """Commands before this session's launch, or acknowledged before a restart, are history."""
    from gpu_console.engine.control import CODES, Control
    from gpu_console.events import EventWriter, append_control

    run = tmp_path / "run"
    run.mkdir()
    append_control(run, "stop")  # the command that ended the previous session
    since = (run / "control.jsonl").stat().st_size
    events = EventWriter(run / "events.jsonl")
    events.emit("status", state="stopped", step=7)
    events_from = (run / "events.jsonl").stat().st_size
    meta = {"id": "run", "sessions": [{}, {"control_from": since, "events_from": events_from}]}
    (run / "meta.json").write_text(json.dumps(meta))
    # This session: a checkpoint taken up before a restart of the group, then a pause.
    done = append_control(run, "checkpoint")
    events.emit("control", id=done, cmd="checkpoint", state="received", step=9)
    events.close()
    append_control(run, "pause")

    control = Control(run, is_reader=True, interval_s=0.25)
    assert control.proposal(10)[0] == CODES["pause"]
    assert control.proposal(11)[0] == 0


def test_a_resume_by_a_relative_path_from_another_directory(procs, runs_dir, tmp_path, stopped):
    # The resumed session's torchrun starts where the run was launched: a run directory the
    # console was given relative to its own directory failed every rank there (and left a
    # skeleton of logs under that directory). The module's stopped run, launched in
    # stopped.launched_in as "rel", copied to ./runs/rel here.
    launched_in = stopped.launched_in
    assert stopped.console.returncode == 0, stopped.out + stopped.err
    run = Path(shutil.copytree(stopped.run, runs_dir / "rel", symlinks=True))
    assert json.loads((run / "meta.json").read_text())["cwd"] == str(launched_in)
    at = read_status(run)["step"]
    resumed = procs.cli(
        "run", "--resume", "runs/rel", "--headless", "--set", f"train.max_steps={at + 3}",
        "--set", "train.log_every=1", cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert events_of(runs_dir / "rel", "step")[-1]["step"] == at + 3
    assert list(launched_in.iterdir()) == []
