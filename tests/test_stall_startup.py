"""A rank frozen before its first step is ``stalled`` within the stall limit, everywhere;
a long start-up whose heartbeats still beat is not; ``stop`` on a stalled run says so at
once and names ``--now``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time

import conftest
from conftest import only_run, read_status, run_dirs, wait_for

from gpu_console import strict_json
from gpu_console.fold import derived_state
from gpu_console.heartbeats import frozen_ranks
from gpu_console.state import read_heartbeats
from gpu_console.tui.feed import RunFeed

STALL_S = 5.0

# Every rank spends minutes building its datasets: a long start-up phase, its heartbeat alive.
# Only in a rank: the launch's own data check (a subprocess outside torchrun) builds them fast.
SLOW_START = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class SlowStart(MLPTask):
    def build_datasets(self):
        if "LOCAL_RANK" in os.environ:
            time.sleep(600)
        return super().build_datasets()
"""


def _ls_state(procs, runs_dir, env) -> str:
    out = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), env=env)
    (row,) = strict_json.loads(out.stdout)
    return row["state"]


def test_a_rank_frozen_in_start_up_is_stalled_and_stop_says_use_now(
    procs, runs_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", str(STALL_S))  # for the TUI's feed, read here
    profile = conftest.task_profile(tmp_path, "slow_start", SLOW_START, "SlowStart", ranks=2)
    env = conftest.test_env(GPU_CONSOLE_STALL_S=str(STALL_S))
    out_path = tmp_path / "console.out"
    with open(out_path, "w") as out:
        console = procs.start(
            "run", str(profile), "--headless", "--runs-dir", str(runs_dir),
            cwd=tmp_path, env=env, stdout=out,
        )  # fmt: skip
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    beats = wait_for(
        lambda: len(b := read_heartbeats(run)) == 2 and all(x.get("pid") for x in b) and b,
        what="both ranks' heartbeats",
    )
    # Longer than the stall limit in start-up, every heartbeat beating: not a stall.
    started = wait_for(lambda: read_status(run).get("started"), what="status.json")
    wait_for(lambda: time.time() > started + STALL_S + 3, what="a start-up longer than the limit")
    assert _ls_state(procs, runs_dir, env) == "starting"

    rank1 = next(b for b in beats if b["rank"] == 1)["pid"]
    os.kill(rank1, signal.SIGSTOP)
    try:
        frozen_at = time.time()
        wait_for(lambda: _ls_state(procs, runs_dir, env) == "stalled", what="ls: stalled")
        assert time.time() - frozen_at < STALL_S + 10  # the limit, and a loaded machine's slack
        assert [b["rank"] for b in frozen_ranks(run, time.time(), STALL_S)] == [1]

        shown = procs.cli("status", run.name, "--json", "--runs-dir", str(runs_dir), env=env)
        assert strict_json.loads(shown.stdout)["state"] == "stalled"
        text = procs.cli("status", run.name, "--runs-dir", str(runs_dir), env=env).stdout
        assert "stalled" in text
        feed = RunFeed(run, telemetry=False)  # the TUI's run screen
        feed.load()
        snap = feed.snapshot()
        assert snap.state == "stalled" and "rank 1 (no heartbeat for" in snap.reason
        wait_for(
            lambda: "stopped: rank 1 (no heartbeat for" in out_path.read_text(),
            what="the headless console to name rank 1",
        )

        asked = time.monotonic()
        stop = procs.cli("stop", run.name, "--runs-dir", str(runs_dir), env=env)
        assert time.monotonic() - asked < 20  # at once, not after the 60 s acknowledgement wait
        assert stop.returncode == 1, stop.stdout + stop.stderr
        line = stop.stderr.strip()
        assert line.startswith(f"gpu-console: {run.name} is stalled: rank 1 (no heartbeat for")
        assert line.endswith(f"use gpu-console stop {run.name} --now") and "\n" not in line
        control = run / "control.jsonl"
        assert not control.exists() or '"stop"' not in control.read_text()  # nothing was sent

        killed = procs.cli("stop", run.name, "--now", "--runs-dir", str(runs_dir), env=env)
        assert killed.returncode == 0, killed.stdout + killed.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGCONT)
    assert console.wait(timeout=conftest.DEADLINE_S) == 137
    assert read_status(run)["state"] == "killed"
    printed = out_path.read_text()
    assert "stalled (starting); stopped: rank 1 (no heartbeat for" in printed
    assert " again" not in printed  # its ranks were killed: not "moving again"


def _beat(run, rank: int, **fields) -> None:
    folder = run / "heartbeats"
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "phase": "starting"}
    (folder / f"rank-{rank:05d}.json").write_text(json.dumps({**doc, **fields}))


def test_only_a_live_rank_silent_this_session_is_frozen(tmp_path):
    now = 1000.0
    _beat(tmp_path, 0, t=now - 1)  # beating
    _beat(tmp_path, 1, t=now - 20)  # silent, alive (this process): frozen
    _beat(tmp_path, 2, t=now - 20, phase="done")  # ended
    _beat(tmp_path, 3, t=now - 20, pid=2**22 + 12345)  # gone: torchrun's to report
    _beat(tmp_path, 4, t=now - 200)  # an earlier session's record
    frozen = frozen_ranks(tmp_path, now, 10.0, since=now - 100)
    assert [b["rank"] for b in frozen] == [1]
    assert frozen_ranks(tmp_path, now, 30.0, since=now - 100) == []  # within the limit


def test_derived_state_reads_the_heartbeats_in_any_live_phase(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", "10")
    now = time.time()
    status = {"state": "compiling", "pids": {"supervisor": os.getpid()}, "started": now - 60}
    _beat(tmp_path, 0, t=now - 1, phase="compute")
    assert derived_state(status, now, run_dir=tmp_path) == "compiling"  # long, but beating
    _beat(tmp_path, 1, t=now - 11, phase="compute")
    assert derived_state(status, now, run_dir=tmp_path) == "stalled"
    assert derived_state(status, now) == "compiling"  # without the heartbeats: no sign
    assert derived_state({**status, "ended": now}, now, run_dir=tmp_path) == "compiling"
