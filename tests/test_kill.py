"""Kill means kill: ``stop --now`` and the headless second Ctrl-C end a run at once, with no
checkpoint and no traceback, hung ranks included; one exit code everywhere (DESIGN.md).

Real torchrun, 2 CPU ranks: the console → supervisor → torchrun → ranks tree of a user's run.
"""

from __future__ import annotations

import json
import re
import signal

import conftest
from conftest import (
    HANGING_TASK,
    deadline,
    events_of,
    fast_profile,
    paced_profile,
    pid_alive,
    read_status,
    task_profile,
    the_run,
    wait_for,
)

from gpu_console.state import read_heartbeats

# Rank 1 hangs in its 6th batch; rank 0 goes on into the step's all-reduce and waits there
# for it: one rank stuck in a step, its peer stuck in a collective.
ONE_RANK_HANGS = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class OneHangs(MLPTask):
    calls = 0

    def compute(self, model, batch):
        OneHangs.calls += 1
        if OneHangs.calls == 6 and os.environ["RANK"] == "1":
            time.sleep(600)
        return super().compute(model, batch)
"""


def _start(procs, runs_dir, tmp_path, profile, env=None):
    out = open(tmp_path / "console.out", "w")  # noqa: SIM115 - the console writes it
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path, stdout=out,
        env=env,
    )  # fmt: skip
    out.close()
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    return console, run


def _printed(tmp_path) -> str:
    return (tmp_path / "console.out").read_text()


def _workers(run):
    return wait_for(
        lambda: (s := read_status(run)) and len(s["pids"].get("workers") or []) == 2 and s,
        what="two worker pids in status.json",
    )


def _tree_pids(status) -> list[int]:
    return [status["pids"]["supervisor"], status["pids"]["torchrun"], *status["pids"]["workers"]]


def _ls_row(procs, runs_dir, run) -> dict:
    rows = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    return next(r for r in rows if r["name"] == run.name)


def _assert_ended_at_once(procs, runs_dir, tmp_path, run, console, status, state, code):
    """The run ended ``state`` with ``code`` everywhere, no checkpoint, nothing shown as a
    crash, and no process of it left."""
    _, err = console.communicate(timeout=deadline(120))
    printed = _printed(tmp_path)
    assert console.returncode == code, printed + err
    final = read_status(run)
    assert final["state"] == state and final["exit_code"] == code, final
    assert final["checkpointed_on_stop"] is False and "failure" not in final
    assert isinstance(final["torchrun_exit"], int)  # torchrun's own, kept beside
    row = _ls_row(procs, runs_dir, run)
    assert (row["state"], row["exit_code"]) == (state, code)
    assert events_of(run, "checkpoint") == []
    assert not (run / "checkpoints" / "LATEST").exists()
    # No torchrun SignalException, no rank traceback: nothing of a kill reads as a crash.
    log = (run / "logs" / "torchrun.log").read_text()
    assert "SignalException" not in log and "Traceback" not in log, log[-3000:]
    assert "Traceback" not in printed and "failure" not in printed
    assert re.search(rf"\b{state}\b", printed), printed
    wait_for(lambda: not any(pid_alive(p) for p in _tree_pids(status)), 30, "no process left")
    return final


def test_stop_now_kills_a_running_run_no_checkpoint_exit_137(procs, runs_dir, tmp_path):
    console, run = _start(
        procs, runs_dir, tmp_path, fast_profile(tmp_path, max_steps=1_000_000, ranks=2)
    )
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    status = _workers(run)
    assert _ls_row(procs, runs_dir, run)["exit_code"] is None  # live: no exit code yet

    result = procs.cli("stop", run.name, "--now", "--runs-dir", str(runs_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{run.name}: killed (exit code 137)"
    final = _assert_ended_at_once(procs, runs_dir, tmp_path, run, console, status, "killed", 137)
    assert final["reason"] == "on request, no checkpoint"
    again = procs.cli("stop", run.name, "--now", "--runs-dir", str(runs_dir))
    assert again.returncode == 2 and "already ended (state killed)" in again.stderr


def test_stop_now_kills_a_run_whose_rank_is_hung(procs, runs_dir, tmp_path):
    profile = task_profile(
        tmp_path, "onehangs", ONE_RANK_HANGS, "OneHangs", max_steps=1000, ranks=2
    )
    console, run = _start(procs, runs_dir, tmp_path, profile)
    status = _workers(run)

    def hung() -> bool:  # rank 1 sits in step 6's compute; rank 0 waits for it
        beats = {b["rank"]: b for b in read_heartbeats(run)}
        return 1 in beats and beats[1]["step"] == 6 and beats[1]["phase"] == "compute"

    wait_for(hung, what="rank 1 hung in step 6")
    assert events_of(run, "step")[-1]["step"] == 5
    result = procs.cli("stop", run.name, "--now", "--runs-dir", str(runs_dir))
    assert result.returncode == 0, result.stderr
    assert "killed (exit code 137)" in result.stdout  # recorded within stop's 10 s wait
    _assert_ended_at_once(procs, runs_dir, tmp_path, run, console, status, "killed", 137)


def test_second_ctrl_c_interrupts_at_once_exit_130(procs, runs_dir, tmp_path):
    # Every rank hangs in step 6: the first Ctrl-C's graceful stop can never be reached.
    profile = task_profile(tmp_path, "hanging", HANGING_TASK, "Hanging", max_steps=1000, ranks=2)
    console, run = _start(procs, runs_dir, tmp_path, profile)
    status = _workers(run)
    wait_for(lambda: len(events_of(run, "step")) >= 5, what="five steps, then the hang")
    console.send_signal(signal.SIGINT)
    wait_for(lambda: '"stop"' in (run / "control.jsonl").read_text(), what="the stop command")
    # Pending signals of one kind merge: the second only once the first took effect.
    wait_for(lambda: "stopping" in _printed(tmp_path), what="the first Ctrl-C's effect")
    console.send_signal(signal.SIGINT)
    final = _assert_ended_at_once(
        procs, runs_dir, tmp_path, run, console, status, "interrupted", 130
    )
    assert final["reason"] == "killed before a checkpoint"


def test_one_ctrl_c_stops_with_a_checkpoint_at_the_step_the_summary_shows(
    procs, runs_dir, tmp_path
):
    # Step events every 50 steps (1 s), control checks every 0.25 s: the stop usually lands
    # between two step events, as on a user's run.
    profile = paced_profile(tmp_path, max_steps=100_000)
    profile.write_text(profile.read_text().replace("log_every = 1", "log_every = 50"))
    console, run = _start(procs, runs_dir, tmp_path, profile, env=conftest.test_env(PACE_S="0.02"))
    wait_for(lambda: events_of(run, "step"), what="a first step event")
    console.send_signal(signal.SIGINT)
    _, err = console.communicate(timeout=deadline(120))
    printed = _printed(tmp_path)
    assert console.returncode == 0, printed + err
    final = read_status(run)
    assert final["state"] == "stopped" and final["exit_code"] == 0, final
    assert _ls_row(procs, runs_dir, run)["exit_code"] == 0
    (ckpt,) = events_of(run, "checkpoint")
    assert ckpt["reason"] == "stop"
    assert final["step"] == ckpt["step"]
    # The summary's steps (a table row or a `steps: N/M` line) is the checkpoint's step.
    shown = re.search(r"\bsteps\b[^\d\n]*(\d+)/", printed)
    assert shown and int(shown.group(1)) == ckpt["step"], printed


def test_one_exit_code_per_end():
    """DESIGN.md's table, in the one function status.json, ls, the summary and the TUI use."""
    from gpu_console.runs import exit_code, status_exit_code

    assert [exit_code(s) for s in ("finished", "stopped", "failed", "lost")] == [0, 0, 1, 1]
    assert exit_code("stopped", checkpointed=False) == 130  # its checkpoint was not written
    assert (exit_code("interrupted"), exit_code("killed")) == (130, 137)
    assert [exit_code(s) for s in ("starting", "running", "paused", "stalled")] == [None] * 4
    # From status.json: a stop counts as checkpointed only where the supervisor said so.
    assert status_exit_code({"state": "stopped", "checkpointed_on_stop": True}) == 0
    assert status_exit_code({"state": "stopped"}) == 130
    assert status_exit_code({"state": "running"}, "lost") == 1
