"""SLURM as the console meets it: a job's environment (fake ``SLURM_*``), and ``scontrol`` as a
fake on PATH (the boundary: it logs what it was asked and answers like the real one). The
runs are real: the console, the supervisor, torchrun and CPU ranks."""

from __future__ import annotations

import os
import signal
import socket
import stat
from pathlib import Path

import pytest
from conftest import (
    DEADLINE_S,
    events_of,
    fast_profile,
    paced_profile,
    read_status,
    run_dirs,
    wait_for,
)
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console import launch, slurm

FAKE_SCONTROL = """#!/bin/sh
# scontrol, as far as gpu-console asks it: host lists, a node's address, requeue (logged,
# answered). The node names do not resolve (NodeName=node01 NodeAddr=127.0.0.1), as at sites.
echo "$*" >> "$FAKE_SLURM_LOG"
case "$1 $2" in
  "show hostnames") for h in $FAKE_SLURM_HOSTS; do echo "$h"; done ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
               echo "   CPUAlloc=0 CPUTot=2 CPULoad=0.00"
               echo "   NodeAddr=127.0.0.1 NodeHostName=$3 Version=22.05.8" ;;
  "requeue "*) if [ -n "$FAKE_SCONTROL_FAIL" ]; then
                 echo "scontrol: error: $FAKE_SCONTROL_FAIL" >&2; exit 1
               fi ;;
  *) exit 1 ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path) -> Path:
    """A fake ``scontrol`` first on PATH; returns the log of its calls."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(FAKE_SCONTROL)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return tmp_path / "scontrol.log"


def job_env(tmp_path: Path, job_id: str, *, nnodes: int = 1, node: int = 0, **extra: str):
    """The environment srun gives one task of a job (one console per node), PATH with the
    fake scontrol first."""
    slurm_vars = dict(
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NUM_NODES=str(nnodes),
        SLURM_NNODES=str(nnodes),
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node),
        SLURM_JOB_NODELIST=f"node[01-{nnodes:02d}]",
        SLURM_STEP_ID="0",
        SLURM_STEP_TASKS_PER_NODE=f"1(x{nnodes})",
        SLURM_RESTART_COUNT="0",
    )
    return cli_env(
        PATH=f"{tmp_path / 'slurm-bin'}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(tmp_path / "scontrol.log"),
        FAKE_SLURM_HOSTS=" ".join(f"node{i + 1:02d}" for i in range(nnodes)),
        **(slurm_vars | extra),
    )


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def losses(run: Path) -> dict[int, float]:
    """Step → loss as the events have it (a later session's word for a step wins)."""
    return {e["step"]: e["loss"] for e in events_of(run, "step")}


# -- the job's environment ---------------------------------------------------------------


def test_a_job_is_read_from_its_environment():
    env = {
        "SLURM_JOB_ID": "81234",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08,11],login1",
        "SLURM_RESTART_COUNT": "3",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    }
    job = slurm.job(env)
    assert (job.job_id, job.nnodes, job.node_id, job.restart_count) == ("81234", 4, 2, 3)
    assert job.rdzv_id == "slurm-81234" and job.rdzv_port == 21234
    assert slurm.expand_hostlist(job.nodelist) == ["gpu07", "gpu08", "gpu11", "login1"]
    assert slurm.job({"SLURM_NNODES": "2"}) is None, "no job id: not in a job"


def test_host_lists_with_several_brackets_expand_and_a_bad_one_is_one_line(procs, runs_dir):
    # Where scontrol is absent: python-hostlist reads what the hand-written expansion got
    # wrong (a second bracket in one name) and what it crashed on (a letter range).
    assert slurm.expand_hostlist("rack[1-2]-n[01-02]") == [
        "rack1-n01",
        "rack1-n02",
        "rack2-n01",
        "rack2-n02",
    ]
    with pytest.raises(slurm.SlurmError, match=r"SLURM_JOB_NODELIST: cannot read 'node\[a-c\]'"):
        slurm.expand_hostlist("node[a-c]")
    env = cli_env(SLURM_JOB_ID="1", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[a-c]",
                  PATH="/usr/bin:/bin")  # fmt: skip
    result = procs.cli("run", "quickstart", "--dry-run", "--devices", "cpu:1", "--runs-dir",
                       str(runs_dir), env=env)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith("gpu-console: SLURM job 1: SLURM_JOB_NODELIST: cannot read"), line
    assert run_dirs(runs_dir) == []


def test_two_jobs_get_two_rendezvous(scontrol, tmp_path, monkeypatch):
    """Two jobs whose first node is the same host: each its own port and id."""
    seen = []
    for job_id in ("700001", "700002"):
        for var, value in job_env(tmp_path, job_id, nnodes=2).items():
            if var.startswith(("SLURM_", "FAKE_", "PATH")):
                monkeypatch.setenv(var, value)
        nodes = launch.job_nodes(None, slurm.job())
        assert nodes.nnodes == "2" and nodes.node_rank == 0
        seen.append((nodes.endpoint, nodes.rdzv_id))
    assert seen == [("127.0.0.1:20001", "slurm-700001"), ("127.0.0.1:20002", "slurm-700002")]
    # The host list from scontrol, and the head node's address (its name does not resolve).
    assert calls(scontrol) == ["show hostnames node[01-02]", "show node node01"] * 2


def test_a_taken_port_on_the_head_node_is_refused_in_one_line(procs, runs_dir, scontrol, tmp_path):
    job_id = "733333"
    taken = socket.socket()
    try:
        taken.bind(("", slurm.PORT_BASE + int(job_id) % slurm.PORT_SPAN))
        taken.listen()
        result = procs.cli("run", str(fast_profile(tmp_path)), "--headless", "--devices", "cpu:1",
                           "--runs-dir", str(runs_dir),
                           env=job_env(tmp_path, job_id, nnodes=2))  # fmt: skip
    finally:
        taken.close()
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert "port 23333" in line and "--rdzv-endpoint" in line and "job 733333" in line, line
    assert run_dirs(runs_dir) == [], "nothing written"


def test_several_tasks_per_node_are_refused(procs, runs_dir, tmp_path, scontrol):
    env = job_env(tmp_path, "7", SLURM_STEP_TASKS_PER_NODE="8")
    result = procs.cli("run", str(fast_profile(tmp_path)), "--headless", "--runs-dir",
                       str(runs_dir), env=env)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--ntasks-per-node=1" in result.stderr and "Traceback" not in result.stderr
    assert run_dirs(runs_dir) == []


def test_two_jobs_on_one_head_node_train_side_by_side(procs, tmp_path, scontrol):
    """Two two-node jobs at once, every node on this machine, the same head: no clash. Each
    job's nodes share a runs directory (docs/clusters.md: node 1 waits for node 0's run)."""
    profile = fast_profile(tmp_path, max_steps=6)
    consoles = {}
    for job_id in ("810001", "810002"):
        for node in (0, 1):
            runs = tmp_path / f"runs-{job_id}"
            consoles[(job_id, node)] = procs.start(
                "run", str(profile), "--headless", "--devices", "cpu:1", "--runs-dir", str(runs),
                env=job_env(tmp_path, job_id, nnodes=2, node=node),
            )  # fmt: skip
            if node == 0:  # past its port check (on one machine node 1's torchrun binds too)
                wait_for(lambda runs=runs: run_dirs(runs), what="node 0's run")
    for key, console in consoles.items():
        out, err = console.communicate(timeout=DEADLINE_S * 2)
        assert console.returncode == 0, (key, out + err)
    for job_id in ("810001", "810002"):
        (run,) = [r for r in run_dirs(tmp_path / f"runs-{job_id}")
                  if read_json_meta(r)["slurm"]["node_id"] == 0]  # fmt: skip
        start = events_of(run, "start")[-1]
        assert start["world_size"] == 2 and start["nodes"] == 2
        argv = " ".join(read_json_meta(run)["torchrun"])
        port = slurm.PORT_BASE + int(job_id) % slurm.PORT_SPAN
        assert f"--rdzv-endpoint=127.0.0.1:{port}" in argv, argv
        assert f"--rdzv-id=slurm-{job_id}" in argv, argv


def read_json_meta(run: Path) -> dict:
    from gpu_console import runs

    return runs.current_session(runs.read_json(run / "meta.json"))


# -- the time limit: checkpoint, requeue, continue ---------------------------------------


def test_the_warning_signal_checkpoints_requeues_and_the_next_job_continues_exactly(
    procs, runs_dir, tmp_path, scontrol
):
    profile = paced_profile(tmp_path, max_steps=24)
    # The uninterrupted run from the engine harness (what torchrun's ranks compute, bit for bit).
    uninterrupted = losses(run_engine(tmp_path, profile, runs_dir=tmp_path / "reference"))

    command = ["run", str(profile), "--headless", "--resume", "auto", "--runs-dir", str(runs_dir)]
    first = procs.start(*command, cwd=tmp_path, env=job_env(tmp_path, "4242", PACE_S="0.1"))
    run = wait_for(lambda: run_dirs(runs_dir) and run_dirs(runs_dir)[0], what="the run")
    wait_for(lambda: any(e["step"] >= 6 for e in events_of(run, "step")), what="step 6")
    os.kill(first.pid, signal.SIGUSR1)  # SLURM's --signal=USR1@120, to the job's task
    out, err = first.communicate(timeout=DEADLINE_S)
    assert first.returncode == 0, out + err
    status = read_status(run)
    assert status["state"] == "requeued" and status["exit_code"] == 0, status
    assert status["requeue"]["job_id"] == "4242" and status["requeue"]["exit_code"] == 0
    stopped_at = status["step"]
    assert 6 <= stopped_at < 24
    assert events_of(run, "checkpoint")[-1]["step"] == stopped_at
    assert calls(scontrol) == ["requeue 4242"], "requeued once, with the job's id"
    assert "SLURM job 4242 requeued (--resume auto continues the run)" in out  # the state
    assert "job 4242, node 0 of 1; requeued: scontrol requeue 4242" in out  # the SLURM row

    # SLURM starts the batch script again: the same command, the same job id.
    env = job_env(tmp_path, "4242", SLURM_RESTART_COUNT="1")
    again = procs.cli(*command, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"--resume auto: {run.name}, the run of SLURM job 4242" in again.stderr
    assert run_dirs(runs_dir) == [run], "one run, one directory"
    assert read_status(run)["state"] == "finished"
    assert calls(scontrol) == ["requeue 4242"], "a job that ends normally is not requeued"
    assert "job 4242, node 0 of 1, started 2 times (requeued)" in again.stdout
    got = losses(run)
    assert sorted(got) == sorted(uninterrupted)
    assert [got[s] for s in sorted(got)] == [uninterrupted[s] for s in sorted(got)]
    sessions = (run / "history").glob("status-*.json")
    assert len(list(sessions)) == 1, "the requeued session is kept in history/"


@pytest.mark.parametrize("case", ["requeue_signal none", "scontrol fails"])
def test_no_requeue_when_not_wanted_or_refused(procs, runs_dir, tmp_path, scontrol, case):
    extra = '\n[cluster]\nrequeue_signal = "none"\n' if case == "requeue_signal none" else ""
    profile = paced_profile(tmp_path, max_steps=200, extra=extra)
    fail = {"FAKE_SCONTROL_FAIL": "Requeue of job 99 not allowed"} if "fails" in case else {}
    env = job_env(tmp_path, "99", PACE_S="0.1", **fail)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                          cwd=tmp_path, env=env)  # fmt: skip
    run = wait_for(lambda: run_dirs(runs_dir) and run_dirs(runs_dir)[0], what="the run")
    wait_for(lambda: events_of(run, "step"), what="a step")
    os.kill(console.pid, signal.SIGUSR1)
    out, err = console.communicate(timeout=DEADLINE_S)
    assert console.returncode == 0, out + err  # stopped with its checkpoint
    status = read_status(run)
    assert status["state"] == "stopped" and status["checkpointed_on_stop"], status
    if fail:
        assert calls(scontrol) == ["requeue 99"]
        assert "NOT requeued: scontrol: error: Requeue of job 99 not allowed" in status["reason"]
        # The console waited for scontrol's answer: its output says what happened, once.
        assert out.count("NOT requeued") == 1 and "; requeue" not in out, out
        assert "state: stopped" in out and "state: requeued" not in out, out
    else:
        assert calls(scontrol) == [] and "requeue" not in status


def test_a_two_node_job_requeues_once_and_both_nodes_continue_from_rank_0s_checkpoint(
    procs, runs_dir, tmp_path, scontrol
):
    """Both nodes' consoles get the signal; the first node's supervisor requeues the job;
    after the requeue every node's --resume auto finds the run that holds the checkpoint (a
    shared runs directory) at the same moment, and the run goes on to its end."""
    profile = paced_profile(tmp_path, max_steps=16)
    command = ["run", str(profile), "--headless", "--devices", "cpu:1", "--resume", "auto",
               "--runs-dir", str(runs_dir)]  # fmt: skip

    def job(pace: str, restarts: str) -> list:
        before = len(run_dirs(runs_dir))
        consoles = []
        for node in (0, 1):
            env = job_env(tmp_path, "556", nnodes=2, node=node, PACE_S=pace,
                          SLURM_RESTART_COUNT=restarts)  # fmt: skip
            consoles.append(procs.start(*command, cwd=tmp_path, env=env))
            if node == 0:  # past its port check (on one machine node 1's torchrun binds too)
                wait_for(lambda: len(run_dirs(runs_dir)) > before, what="node 0's run")
        return consoles

    first = job("0.1", "0")
    wait_for(lambda: len(run_dirs(runs_dir)) == 2, what="both nodes' run directories")
    wait_for(lambda: any(events_of(r, "step") for r in run_dirs(runs_dir)), what="a step")
    for console in first:
        os.kill(console.pid, signal.SIGUSR1)
    for console in first:
        out, err = console.communicate(timeout=DEADLINE_S)
        assert console.returncode == 0, out + err
    assert calls(scontrol).count("requeue 556") == 1, calls(scontrol)
    states = sorted(read_status(r)["state"] for r in run_dirs(runs_dir))
    assert states == ["requeued", "stopped"], states
    holder = next(r for r in run_dirs(runs_dir) if (r / "checkpoints" / "LATEST").exists())
    stopped_at = read_status(holder)["step"]

    again = job("0", "1")
    for console in again:
        out, err = console.communicate(timeout=DEADLINE_S)
        assert console.returncode == 0, out + err
        assert f"--resume auto: {holder.name}, the run of SLURM job 556" in err
    new = [r for r in run_dirs(runs_dir) if events_of(r, "start")[-1].get("resumed_from")]
    assert new, "a node of the new session resumed"
    start = events_of(new[0], "start")[-1]
    assert start["resumed_from"].startswith(str(holder)) and start["start_step"] == stopped_at
    assert max(e["step"] for e in events_of(new[0], "step")) == 16


def test_resume_auto_outside_slurm_needs_an_exact_name(procs, runs_dir, tmp_path):
    profile = str(fast_profile(tmp_path, max_steps=4))
    plain = ["run", profile, "--headless", "--resume", "auto", "--runs-dir", str(runs_dir)]
    refused = procs.cli(*plain)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith("gpu-console: --resume auto: continues the run of this SLURM")
    assert run_dirs(runs_dir) == []

    named = [*plain, "--exact-name", "--name", "nightly"]
    first = procs.cli(*named)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "--resume auto: no run nightly yet; a new run" in first.stderr
    assert [r.name for r in run_dirs(runs_dir)] == ["nightly"]
    again = procs.cli(*named)  # found, and already at its end
    assert again.returncode == 2, again.stdout + again.stderr
    assert "already at max_steps 4" in again.stderr and "nightly" in again.stderr


def test_check_names_the_job_and_its_rendezvous(scontrol, tmp_path, monkeypatch):
    from gpu_console.commands.check import FAIL, PASS, SKIP, WARN, slurm_check

    assert slurm_check({}).status == SKIP
    env = job_env(tmp_path, "734567", nnodes=2, SLURM_RESTART_COUNT="2",
                  SLURM_CPUS_ON_NODE="8", SLURM_JOB_GPUS="2,3")  # fmt: skip
    for var in ("PATH", "FAKE_SLURM_LOG", "FAKE_SLURM_HOSTS"):  # scontrol, as check runs it
        monkeypatch.setenv(var, env[var])
    row = slurm_check(env)
    assert row.status == PASS, row
    assert row.detail == (
        "job 734567: node 0 of 2, requeued 2×; granted 8 CPUs, GPUs 2,3; "
        "rendezvous 127.0.0.1:24567 (slurm-734567)"
    )
    crowded = slurm_check(job_env(tmp_path, "5", SLURM_STEP_TASKS_PER_NODE="4(x2)"))
    assert crowded.status == WARN and "--ntasks-per-node=1" in crowded.detail
    assert FAIL not in {row.status, crowded.status}


def test_the_summary_says_what_scontrol_answered_and_a_failure_once():
    from gpu_console.summary import requeue_unanswered, slurm_text

    job = {"job_id": "7", "node_id": 0, "nnodes": 1}
    command = ["scontrol", "requeue", "7"]
    asked = {**job, "requeue": {"job_id": "7", "command": command}}  # SLURM ended us first
    assert slurm_text(asked) == "job 7, node 0 of 1; requeue asked: scontrol requeue 7"
    done = {**job, "requeue": {"command": command, "exit_code": 0}}
    assert slurm_text(done) == "job 7, node 0 of 1; requeued: scontrol requeue 7"
    for failed in ({"exit_code": 1, "error": "scontrol: error: x"}, {"exit_code": None}):
        # The run's reason says NOT requeued with scontrol's line: not again here.
        assert slurm_text({**job, "requeue": {"command": command, **failed}}) == (
            "job 7, node 0 of 1"
        )
    assert requeue_unanswered({"state": "requeued", "requeue": asked["requeue"]})
    assert not requeue_unanswered({"state": "requeued", "requeue": done["requeue"]})
    assert not requeue_unanswered({"state": "stopped", "requeue": asked["requeue"]})
