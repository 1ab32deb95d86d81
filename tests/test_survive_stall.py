"""A rank alive but stuck: the console says ``stalled``, names it, and dumps every stack."""

from __future__ import annotations

import json
import subprocess

import conftest
import pytest
from conftest import deadline, events_of, only_run, read_status, run_dirs, wait_for

from gpu_console.commands import runs as runs_cmd
from gpu_console.state import describe_stopped, read_heartbeats, stopped_ranks

# Rank 1 blocks in its data (a dead NFS mount, say) on its 8th batch; rank 0 goes on to its
# forward and backward, then waits for rank 1 in the gradient all-reduce.
STUCK_DATA = """
import os
import time
from gpu_console.tasks.base import TensorSet
from gpu_console.tasks.mlp import MLPTask


class SlowSet(TensorSet):
    calls = 0

    def __getitems__(self, indices):
        SlowSet.calls += 1
        if os.environ["RANK"] == "1" and SlowSet.calls == 8:
            time.sleep(600)
        return super().__getitems__(indices)


class StuckData(MLPTask):
    def build_datasets(self):
        train, evals = super().build_datasets()
        return SlowSet(*train.tensors), evals
"""


def test_a_stuck_rank_is_flagged_stalled_named_and_dumped(procs, runs_dir, tmp_path):
    profile = conftest.task_profile(
        tmp_path, "stuck", STUCK_DATA, "StuckData", max_steps=1000, ranks=2
    )
    env = conftest.test_env(GPU_CONSOLE_STALL_S="3")  # the 30 s minimum, shortened for the test
    out_path = tmp_path / "console.out"
    with open(out_path, "w") as out:
        console = procs.start(
            "run",
            str(profile),
            "--headless",
            "--runs-dir",
            str(runs_dir),
            cwd=tmp_path,
            env=env,
            stdout=out,
        )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    # A loaded machine may pause a step past the 3 s and print an earlier stall that clears.
    printed = wait_for(
        lambda: "stopped: rank 1 (step 8, data, for " in (t := out_path.read_text()) and t,
        what="the console to say rank 1 stalled in step 8",
    )
    line = next(ln for ln in printed.splitlines() if "rank 1 (step 8, data" in ln)
    assert line.startswith("stalled:")
    assert "rank 0" not in line  # rank 0 is waiting for rank 1, not stuck on its own

    beats = {b["rank"]: b for b in read_heartbeats(run)}
    assert (beats[1]["step"], beats[1]["phase"]) == (8, "data")
    assert (beats[0]["step"], beats[0]["phase"]) == (8, "compute")  # in the all-reduce

    rows = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), env=env)
    assert json.loads(rows.stdout)[0]["state"] == "stalled"

    if runs_cmd.py_spy() is None:
        pytest.skip("py-spy is not installed: the dump half of this test needs it")
    assert "gpu-console dump" in printed  # offered where py-spy is there
    dumped = procs.cli("dump", run.name, "--runs-dir", str(runs_dir))
    if dumped.returncode and ("permission" in dumped.stderr.lower() or "ptrace" in dumped.stderr):
        pytest.skip(f"py-spy may not trace processes here: {dumped.stderr.strip()}")
    assert dumped.returncode == 0, dumped.stdout + dumped.stderr
    files = sorted((run / "dumps").glob("*/rank-*.txt"))
    assert [f.name for f in files] == ["rank-0.txt", "rank-1.txt"]
    assert "__getitems__ (stuck.py:" in files[1].read_text()  # where rank 1 is stuck
    assert "backward" in files[0].read_text() or "_train" in files[0].read_text()
    assert str(files[1]) in dumped.stdout

    assert procs.cli("stop", "--now", run.name, "--runs-dir", str(runs_dir)).returncode == 0
    console.communicate(timeout=deadline(120))
    assert read_status(run)["state"] == "killed"  # DESIGN.md: --now ends it killed, exit 137
    assert events_of(run, "step")[-1]["step"] == 7


def test_dump_without_py_spy_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runs_cmd, "py_spy", lambda: None)
    assert runs_cmd.dump_main("any-run", tmp_path) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "gpu-console: dump needs py-spy, which is not installed here (pip install py-spy); "
        "no stack was written"
    )
    assert not list(tmp_path.iterdir())


def test_dump_of_an_ended_run_is_a_bad_input(request, procs):
    if runs_cmd.py_spy() is None:
        pytest.skip("py-spy is not installed")
    fast_run = request.getfixturevalue("fast_run")  # not launched for a skip
    run = fast_run.run  # the session's finished fast run
    assert fast_run.result.returncode == 0
    assert only_run(fast_run.runs_dir) == run
    result = procs.cli("dump", run.name, "--runs-dir", str(fast_run.runs_dir))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpu-console: {run}: the run has already ended (state finished)"
    )


# -- who stopped: the reading of heartbeats (no processes needed) -----------------------------


def beat(rank, step, phase, t=100.0, since=90.0):
    return {"rank": rank, "pid": 1000 + rank, "step": step, "phase": phase, "t": t, "since": since}


def test_the_rank_behind_is_the_one_named():
    beats = [beat(0, 8, "compute"), beat(1, 8, "data"), beat(2, 8, "compute")]
    assert [b["rank"] for b in stopped_ranks(beats, now=101.0)] == [1]
    assert describe_stopped(beats, now=101.0) == "rank 1 (step 8, data, for 11 s)"


def test_an_earlier_step_is_behind_a_later_phase():
    beats = [beat(0, 9, "data"), beat(1, 8, "control")]
    assert [b["rank"] for b in stopped_ranks(beats, now=101.0)] == [1]


def test_ranks_at_the_same_point_are_all_named():
    beats = [beat(0, 8, "compute"), beat(1, 8, "compute")]
    assert [b["rank"] for b in stopped_ranks(beats, now=101.0)] == [0, 1]


def test_a_silent_heartbeat_names_a_frozen_rank_first():
    beats = [beat(0, 8, "data"), beat(1, 8, "compute", t=80.0)]
    assert describe_stopped(beats, now=101.0) == "rank 1 (no heartbeat for 21 s)"


def test_ended_ranks_are_not_stopped():
    assert stopped_ranks([beat(0, 8, "done"), beat(1, 8, "failed")], now=101.0) == []


def test_a_heartbeat_file_is_rewritten_in_place_and_read_back(tmp_path):
    from gpu_console.engine.heartbeat import RECORD_BYTES, Heartbeat, path_for

    hb = Heartbeat(tmp_path, rank=3, local_rank=1, restart=2)
    hb.set(41, "update")
    hb._write()
    (got,) = read_heartbeats(tmp_path)
    assert (got["rank"], got["local_rank"], got["restart"]) == (3, 1, 2)
    assert (got["step"], got["phase"]) == (41, "update")
    hb.close("done")
    assert read_heartbeats(tmp_path)[0]["phase"] == "done"
    assert path_for(tmp_path, 3).stat().st_size == RECORD_BYTES


def test_the_stall_limit_follows_the_median_step_time(monkeypatch):
    import os
    import time

    from gpu_console.state import derived_state

    monkeypatch.delenv("GPU_CONSOLE_STALL_S", raising=False)
    live = {"state": "running", "pids": {"supervisor": os.getpid()}}
    now = time.time()
    assert derived_state({**live, "last_step_t": now - 29}, now) == "running"
    assert derived_state({**live, "last_step_t": now - 31}, now) == "stalled"
    slow = {**live, "last_step_t": now - 31, "step_time_s": 5.0}  # 10 × 5 s = 50 s
    assert derived_state(slow, now) == "running"
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", "2")
    assert derived_state({**live, "last_step_t": now - 3}, now) == "stalled"


def test_py_spy_is_found_beside_this_python(monkeypatch, tmp_path):
    monkeypatch.setattr(runs_cmd.shutil, "which", lambda name: None)
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(runs_cmd.sysconfig, "get_path", lambda name: str(tmp_path))
    assert runs_cmd.py_spy() == str(fake)


def test_dump_runs_py_spy_as_an_argument_list(monkeypatch, tmp_path):
    calls = []

    def fake_run(argv, **kw):
        calls.append((argv, kw))
        return subprocess.CompletedProcess(argv, 0, "Thread 1 (idle)\n", "")

    monkeypatch.setattr(runs_cmd.subprocess, "run", fake_run)
    monkeypatch.setattr(runs_cmd, "_live", lambda run: {"pids": {"workers": [11, 12]}})
    monkeypatch.setattr(runs_cmd, "rank_pids", lambda run, status: [(0, 11), (1, 12)])
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.toml").write_text("")
    folder, results = runs_cmd.dump(str(tmp_path / "r"), tmp_path, "/x/py-spy")
    assert [c[0] for c in calls] == [
        ["/x/py-spy", "dump", "--pid", "11"],
        ["/x/py-spy", "dump", "--pid", "12"],
    ]
    assert all("shell" not in c[1] for c in calls)
    assert [r["path"].name for r in results] == ["rank-0.txt", "rank-1.txt"]
    assert (folder / "rank-1.txt").read_text() == "# rank 1 pid 12\nThread 1 (idle)\n"
