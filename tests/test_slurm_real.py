"""SLURM for real: the project's own ``examples/slurm/train.sbatch`` submitted to a real
scheduler (tests/slurm_cluster.py: munged, slurmctld and two slurmd on this machine).

The script runs as a user would submit it, with its GPU lines removed (these nodes have
none; ``CUDA_VISIBLE_DEVICES=""`` pins the CPU where a test machine has GPUs). What only a
real scheduler shows: its signals reach every process of the job step at once, at a moment
nobody picks (the console still importing, torchrun before its workers); ``scontrol
requeue`` ends the job's processes, the supervisor included, before it answers; a requeued
job is held before it may start again; the node names do not resolve. The fake ``scontrol``
of test_slurm.py stays for what a real one cannot produce (a refused requeue).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import socket
import sys
from pathlib import Path

import conftest
import pytest
import slurm_cluster
from conftest import (
    DEADLINE_S,
    deadline,
    events_of,
    paced_profile,
    pinned_env,
    read_status,
    run_dirs,
)

from gpu_console import slurm

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = slurm_cluster.missing()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

STEPS = 300
# A limited job: the example's warning (SIGUSR1 70 s before the limit, which slurmctld sends
# at its first 30-second check inside 100 s of the end) and a limit brought in once the run
# trains (`limited_job`). Until the job is requeued each step takes PACE_S: 150 s of steps,
# more than the 135 s the limit leaves it at most.
WARNING = "--signal=USR1@70"
PACE_S = "0.5"
AT_STEP = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The user's directory: the batch script as the example has it (GPU lines removed),
    the paced task's profile, and the runs directory every node shares."""
    tmp = tmp_path_factory.mktemp("work")
    lines = (REPO / "examples" / "slurm" / "train.sbatch").read_text().splitlines()
    gpu_lines = ("--gpus-per-node", "--cpus-per-task")
    kept = [line for line in lines if not any(g in line for g in gpu_lines)]
    assert len(kept) == len(lines) - 2, "the example's GPU lines"
    (tmp / "train.sbatch").write_text("\n".join(kept) + "\n")
    paced_profile(tmp, max_steps=STEPS, extra="[checkpoint]\nevery_steps = 1000\n")
    return tmp


@pytest.fixture(autouse=True)
def told_on_failure(request, tmp_path):
    """A failed test prints what its jobs left: each job's whole output and each run's status
    and events (a busy machine's failure is read from CI's log, the directories are gone)."""
    yield
    if request.node.stash.get(conftest._CALL_FAILED, False):
        shared = request.getfixturevalue("jobs") if "jobs" in request.fixturenames else {}
        _tell([p for p in tmp_path.iterdir() if p.is_dir()] + [v[0] for v in shared.values()])


def _tell(dirs: list[Path]) -> None:
    for runs in sorted(dirs):
        for out in sorted(runs.glob("job-*.out")):
            print(f"== {out}:\n{out.read_text(errors='replace')}")
        print(conftest.describe_runs(runs, lines=40))


def job_env(work: Path, runs: Path, **extra: str) -> dict[str, str]:
    """The submitting shell's environment (the job inherits it)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return pinned_env(GPU_CONSOLE_RUNS=str(runs), PATH=path, **extra)


def submit(cluster, work: Path, runs: Path, *options: str, **env: str) -> str:
    profile = work / "fast.toml"  # paced_profile's
    runs.mkdir(parents=True, exist_ok=True)  # the job's output file is written there
    return cluster.sbatch(
        work / "train.sbatch", str(profile), options=(f"--output={runs}/job-%j.out", *options),
        env=job_env(work, runs, **env), cwd=work,
    )  # fmt: skip


def ended(job: dict[str, str]) -> bool:
    return job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def losses(run: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run, "step")}


def job_output(runs: Path, job_id: str) -> str:
    return (runs / f"job-{job_id}.out").read_text(errors="replace")


@pytest.fixture(scope="module")
def jobs(cluster, work, tmp_path_factory):
    """The module's minute-scale jobs, submitted together and followed side by side (a time
    limit is a wait of one to two minutes that costs no CPU; one after another they were
    three and a half minutes of the suite): the one-node and two-node uninterrupted runs, the
    same stopped by a time limit, and one signalled in its first second. Each test reads its
    own from here: {name: (runs directory, job id, the job's last state, what was seen)}."""
    root = tmp_path_factory.mktemp("jobs")
    started = {
        "reference": (_uninterrupted, (cluster, work, root / "reference", 1)),
        "reference2": (_uninterrupted, (cluster, work, root / "reference2", 2)),
        "limited": (limited_job, (cluster, work, root / "limited", 1)),
        "limited2": (limited_job, (cluster, work, root / "limited2", 2)),
    }
    with concurrent.futures.ThreadPoolExecutor(len(started) + 1) as pool:
        futures = {name: pool.submit(call, *args) for name, (call, args) in started.items()}
        # The signalled job once the others' start-up is over (while the limited ones wait
        # on their limits): a signal in a job's first second leaves its ranks the profile's
        # shutdown grace from their own start, which six start-ups at once on two cores eat.
        concurrent.futures.wait([futures["reference"], futures["reference2"]])
        futures["signalled"] = pool.submit(_signalled_at_once, cluster, work, root / "signalled")
        concurrent.futures.wait(futures.values())
    try:
        return {name: (root / name, *f.result()) for name, f in futures.items()}
    except BaseException:
        _tell([root / name for name in futures if (root / name).is_dir()])
        raise


def _uninterrupted(cluster, work: Path, runs: Path, nodes: int):
    job_id = submit(cluster, work, runs, f"--nodes={nodes}", "--time=10")
    return job_id, cluster.wait_job(job_id, ended, deadline(300), "end"), {}


def _signalled_at_once(cluster, work: Path, runs: Path):
    """``scancel --signal=USR1`` as soon as the run directory exists."""
    job_id = submit(cluster, work, runs, "--nodes=1", "--time=10")
    cluster.wait_job(job_id, lambda j: run_dirs(runs) or ended(j), deadline(120), "run dir")
    signalled = cluster.run("scancel", "--signal=USR1", job_id, check=False)
    (run,) = run_dirs(runs)
    seen = {
        "scancel": (signalled.returncode, signalled.stderr),
        "stepped": (run / "events.jsonl").exists() and bool(events_of(run, "step")),
    }
    return job_id, cluster.wait_job(job_id, ended, deadline(300), "end"), seen


@pytest.fixture(scope="module")
def reference(cluster, jobs):
    """One node, no time limit to speak of: the losses an uninterrupted run logs."""
    runs, job_id, job, _ = jobs["reference"]
    assert job["JobState"] == "COMPLETED", (job, job_output(runs, job_id), cluster.logs())
    (run,) = run_dirs(runs)
    assert read_status(run)["state"] == "finished"
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def node_runs(runs: Path, node: int) -> list[Path]:
    """The run directories node ``node`` made, oldest first."""

    def meta(run: Path) -> dict:
        return json.loads((run / "meta.json").read_text())

    mine = [r for r in run_dirs(runs) if meta(r)["sessions"][-1]["slurm"]["node_id"] == node]
    return sorted(mine, key=lambda r: meta(r)["created"])


def sessions(run: Path) -> list[dict]:
    """Every session's status.json, the ended ones (history/) and the last."""
    old = [json.loads(p.read_text()) for p in sorted((run / "history").glob("status-*.json"))]
    return [*old, read_status(run)]


def run_seconds(job: dict[str, str]) -> int:
    """A job's ``RunTime`` ([D-]HH:MM:SS) in seconds."""
    days, _, clock = job["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def trained(runs: Path, steps: int) -> bool:
    return any(
        (run / "events.jsonl").exists() and len(events_of(run, "step")) >= steps
        for run in run_dirs(runs)
    )


def limited_job(cluster, work: Path, runs: Path, nodes: int):
    """A job stopped by its time limit, then requeued by the run, to its end: (id, last
    state, nothing more).

    The limit is brought in (``scontrol update TimeLimit``, which a user may do to their own
    job) once the run trains: the first whole minute at least 75 s away, so the warning comes
    within about a minute, wherever in a step it lands, with time left to checkpoint and
    requeue. Once the job was requeued its limit goes back to ten minutes and the pace is
    lifted: the rest of the run is not waited for."""
    pace = runs.parent / f"{runs.name}.pace"
    pace.touch()
    job_id = submit(
        cluster, work, runs, f"--nodes={nodes}", "--time=10", WARNING,
        PACE_S=PACE_S, PACE_WHILE=str(pace),
    )  # fmt: skip
    job = cluster.wait_job(
        job_id, lambda j: ended(j) or trained(runs, AT_STEP), deadline(300), f"step {AT_STEP}"
    )
    assert not ended(job), (job, job_output(runs, job_id))
    minutes = math.ceil((run_seconds(job) + 75) / 60)
    cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")
    job = cluster.wait_job(
        job_id, lambda j: ended(j) or int(j.get("Restarts", "0")) >= 1, deadline(600), "requeue"
    )
    pace.unlink()
    if not ended(job):
        cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    return job_id, cluster.wait_job(job_id, ended, deadline(600), "end"), {}


@pytest.mark.timeout(1200)
def test_a_time_limit_requeues_and_the_run_resumes_exactly(cluster, jobs, reference):
    """The example script stopped by its time limit: the warning (SIGUSR1, 70 s before the
    limit, which SLURM sends up to half a minute early) lands wherever it lands; each job
    checkpoints, records ``requeued`` and requeues itself; the next one resumes."""
    runs, job_id, job, _ = jobs["limited"]
    out = job_output(runs, job_id)
    assert job["JobState"] == "COMPLETED", (job, out, cluster.logs())
    assert int(job["Restarts"]) >= 1, ("the limit came before the run's end", job, out)
    (run,) = run_dirs(runs)
    states = [s["state"] for s in sessions(run)]
    assert states == ["requeued"] * (len(states) - 1) + ["finished"], (states, out)
    assert len(states) == int(job["Restarts"]) + 1
    assert losses(run) == reference, "every logged loss equal to the uninterrupted run's"
    assert "NOT requeued" not in out and "failed" not in out, out
    # Said before the requeue ends the console (a busy machine may end it first).
    assert out.count(f"requeue asked: scontrol requeue {job_id}") <= len(states) - 1, out


@pytest.mark.timeout(1200)
def test_a_signal_in_the_jobs_first_second_requeues_and_the_run_goes_on(jobs, reference):
    """``scancel --signal=USR1`` as soon as the run directory exists: the console is still
    starting, torchrun's workers do not exist. The job is requeued and the run continues."""
    runs, job_id, job, seen = jobs["signalled"]
    assert seen["scancel"][0] == 0, seen["scancel"][1]
    assert not seen["stepped"], "too late"
    (run,) = run_dirs(runs)
    out = job_output(runs, job_id)
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 1, (job, out)
    assert [s["state"] for s in sessions(run)] == ["requeued", "finished"], out
    # torchrun never acted on the warning: it exited 0 after its ranks, both times.
    assert [s["torchrun_exit"] for s in sessions(run)] == [0, 0]
    assert "failed" not in out and "NOT requeued" not in out, out
    assert out.count(f"requeue asked: scontrol requeue {job_id}") <= 1, out
    assert losses(run) == reference


@pytest.mark.timeout(1200)
def test_a_two_node_job_stopped_by_its_limit_resumes_exactly(cluster, jobs):
    """Two nodes (two slurmd on this host): the uninterrupted two-node run, then the same
    stopped by its time limit; every node resumes from rank 0's checkpoint."""
    reference_runs, job_id, job, _ = jobs["reference2"]
    assert job["JobState"] == "COMPLETED", (job, job_output(reference_runs, job_id))
    assert len(run_dirs(reference_runs)) == 2, "one run dir per node"
    (head,) = node_runs(reference_runs, 0)
    uninterrupted = losses(head)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    runs, job_id, job, _ = jobs["limited2"]
    out = job_output(runs, job_id)
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) >= 1, (job, out)
    assert "NOT requeued" not in out and "failed" not in out, out
    starts = node_runs(runs, 0)  # a run directory per node and job start
    assert len(starts) == int(job["Restarts"]) + 1 and len(node_runs(runs, 1)) == len(starts)
    got: dict[int, float] = {}
    for run in starts:
        got.update(losses(run))  # a later start's word for a step wins
    assert got == uninterrupted, "a two-node resume is exact"


def test_a_two_node_job_refused_for_a_taken_port_leaves_no_run_on_any_node(cluster, work, tmp_path):
    runs = tmp_path / "runs"
    job_id = submit(cluster, work, runs, "--nodes=2", "--time=10", "--hold")
    taken = socket.socket()
    try:
        taken.bind(("", slurm.PORT_BASE + int(job_id) % slurm.PORT_SPAN))
        taken.listen()
        cluster.run("scontrol", "release", job_id)
        job = cluster.wait_job(job_id, ended, deadline(DEADLINE_S), "end")
    finally:
        taken.close()
    out = job_output(runs, job_id)
    assert job["JobState"] == "FAILED", (job, out)
    assert f"port {slurm.PORT_BASE + int(job_id) % slurm.PORT_SPAN}" in out, out
    assert "Traceback" not in out, out
    assert run_dirs(runs) == [], "nothing written on either node"
