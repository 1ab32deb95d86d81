"""``gpu-console profile RUN --steps K`` on a live run (real torchrun, 2 CPU ranks): every rank
writes a Chrome trace of the same K steps into the run directory, the log and the ack name
it; a paused run rejects the request; a stop during a capture still writes what it holds.
And ``hardware.memory_snapshot_on_oom`` on CPU ranks: accepted, with no effect, said so."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    deadline,
    events_of,
    paced_profile,
    read_status,
    task_profile,
    the_run,
    wait_for,
)
from conftest import test_env as cli_env

from gpu_console.events import append_control


def _trace_steps(path: Path) -> tuple[set[str], list[str]]:
    """The op names in a trace, and its ProfilerStep ranges (one per recorded step)."""
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    return names, sorted(n for n in names if n.startswith("ProfilerStep#"))


def _ack(run: Path, cid: str, state: str) -> dict | None:
    return next(
        (e for e in events_of(run, "control") if e["id"] == cid and e["state"] == state), None
    )


def test_profile_traces_the_next_steps_on_every_rank(procs, runs_dir, tmp_path):
    profile = paced_profile(tmp_path, max_steps=1_000_000, ranks=2)
    env = cli_env(PACE_S="0.02")
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                "--set", "hardware.memory_snapshot_on_oom=true", env=env, cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    # The OOM snapshot is CUDA's: on CPU ranks the key is accepted, and the start says so.
    (start,) = events_of(run, "start")
    assert start["memory_snapshot_on_oom"] == "no effect without CUDA"
    assert "hardware.memory_snapshot_on_oom = true: no effect without CUDA" in [
        e["message"] for e in events_of(run, "log") if e["level"] == "warning"
    ]
    rd = ["--runs-dir", str(runs_dir)]

    # Bad --steps: one line, exit 2, nothing sent.
    for bad in ("0", "-3", "x", "1001"):
        res = procs.cli("profile", run.name, "--steps", bad, *rd, cwd=tmp_path)
        assert res.returncode == 2, (bad, res.stdout, res.stderr)
        assert res.stderr.strip().splitlines() == [
            f"gpu-console: --steps: a whole number from 1 to 1000 (got {bad!r})"
        ]
    assert (
        not (run / "control.jsonl").exists() or "profile" not in (run / "control.jsonl").read_text()
    )

    res = procs.cli("profile", run.name, "--steps", "3", *rd, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    folder = Path(res.stdout.split(" (")[0])
    assert folder.parent == run / "profiles"
    traces = sorted(p.name for p in folder.iterdir())
    assert traces == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for name in traces:
        names, steps = _trace_steps(folder / name)
        assert "aten::addmm" in names  # the MLP's forward
        assert "autograd::engine::evaluate_function: AddmmBackward0" in names  # its backward
        assert len(steps) == 3, steps  # the warmup step is not recorded

    (cmd,) = [json.loads(x) for x in (run / "control.jsonl").read_text().splitlines()]
    assert cmd["cmd"] == "profile" and cmd["steps"] == 3
    done = _ack(run, cmd["id"], "done")
    assert done["path"] == str(folder) and done["steps"] == 3 and done["ranks"] == 2
    assert folder.name == f"step-{done['first_step']:08d}"  # its first recorded step
    assert done["last_step"] - done["first_step"] == 2 and done["ended_by"] == "complete"
    assert f"profile: {res.stdout.split(' (')[1].split(',')[0]} traced on 2 ranks: {folder}" in [
        e["message"].split(" (open")[0] for e in events_of(run, "log")
    ]
    (event,) = events_of(run, "profile")
    assert event["path"] == str(folder)
    status = procs.cli("status", run.name, "--json", *rd, cwd=tmp_path)
    assert json.loads(status.stdout)["profiles"][0]["path"] == str(folder)

    # Paused: no steps to trace, so the request is rejected, saying why.
    append_control(run, "pause")
    wait_for(lambda: read_status(run).get("state") == "paused", what="the run paused")
    res = procs.cli("profile", run.name, *rd, cwd=tmp_path)
    assert res.returncode == 1 and "the run is paused" in res.stderr, res.stderr
    append_control(run, "resume")
    res = procs.cli("profile", run.name, "--steps", "1", "--json", *rd, cwd=tmp_path)
    answer = json.loads(res.stdout)
    assert res.returncode == 0 and answer["state"] == "done" and answer["steps"] == 1
    assert answer["files"] == [str(Path(answer["path"]) / f"rank{r}.pt.trace.json") for r in (0, 1)]

    # A stop during a long capture: the steps recorded so far are written, and acknowledged.
    cid = append_control(run, "profile", steps=1000)
    received = wait_for(lambda: _ack(run, cid, "received"), what="the capture started")
    wait_for(lambda: events_of(run, "step")[-1]["step"] >= received["step"] + 3, what="steps")
    again = append_control(run, "profile", steps=2)  # while one is running: rejected
    rejected = wait_for(lambda: _ack(run, again, "rejected"), what="the second one rejected")
    assert "in progress" in rejected["reason"]
    append_control(run, "stop")
    wait_for(lambda: read_status(run).get("state") == "stopped", what="the run stopped")
    cut = _ack(run, cid, "done")
    assert cut["ended_by"] == "stop" and cut["ranks"] == 2 and cut["steps"] >= 2
    for rank in (0, 1):
        names, steps = _trace_steps(Path(cut["path"]) / f"rank{rank}.pt.trace.json")
        assert "aten::addmm" in names and len(steps) >= cut["steps"]
    assert [e["path"] for e in events_of(run, "profile")] == [
        str(folder),
        answer["path"],
        cut["path"],
    ]
    # The headless console said so as it happened, and its summary names the newest (relative
    # to the run directory, as it names every path of the run).
    out, _ = console.communicate(timeout=deadline(60))
    assert f"profile: steps {done['first_step']}-{done['last_step']} traced: {folder}" in out
    newest = Path(cut["path"]).relative_to(run)
    assert f"profile: {newest} (steps {cut['first_step']}-{cut['last_step']}; 3 captures" in out


def test_an_oom_failure_names_the_memory_snapshot_first():
    """The snapshot's path comes before the long CUDA message: status keeps 500 characters."""
    import torch

    from gpu_console.engine.loop import oom_message
    from gpu_console.profile import Profile

    d = SimpleNamespace(rank=1, device=torch.device("cpu"))
    snapshot = Path("/runs/r/oom-memory-rank1.pickle")
    long = "CUDA out of memory. Tried to allocate 20.00 GiB. " + "x" * 600
    message = oom_message(torch.OutOfMemoryError(long), d, Profile(), 7, snapshot)
    assert f"OutOfMemory: {message}"[:500].startswith(
        f"OutOfMemory: rank 1 ran out of memory on cpu in step 7 (CUDA memory snapshot: {snapshot}"
    )
    assert "snapshot" not in oom_message(torch.OutOfMemoryError(long), d, Profile(), 7)


# Rank 0 raises once the test creates FAIL_FILE: a failure in the middle of a capture.
FAILING_TASK = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class Failing(MLPTask):
    def compute(self, model, batch):
        time.sleep(float(os.environ.get("PACE_S", "0")))
        if os.environ.get("RANK") == "0" and os.path.exists(os.environ["FAIL_FILE"]):
            raise RuntimeError("failing mid-capture, as asked")
        return super().compute(model, batch)
"""


def test_a_rank_that_fails_mid_capture_writes_what_it_captured(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "failing", FAILING_TASK, "Failing", max_steps=1_000_000)
    fail = tmp_path / "fail-now"
    env = cli_env(PACE_S="0.02", FAIL_FILE=str(fail))
    procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir), env=env,
                cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    cid = append_control(run, "profile", steps=1000)
    received = wait_for(lambda: _ack(run, cid, "received"), what="the capture started")
    wait_for(lambda: events_of(run, "step")[-1]["step"] >= received["step"] + 3, what="steps")
    fail.touch()
    # Its end, not its failed state: the rank writes what it captured on its way out, after
    # its status event (a busy machine read the trace in between).
    final = wait_for(lambda: (s := read_status(run)).get("ended") and s, what="the run's end")
    assert final["state"] == "failed", final
    folder = run / "profiles" / f"step-{received['step'] + 2:08d}"
    names, steps = _trace_steps(folder / "rank0.pt.trace.json")
    assert "aten::addmm" in names and len(steps) >= 2
    assert _ack(run, cid, "done") is None and events_of(run, "profile") == []


@pytest.mark.quick
def test_a_stop_before_a_step_was_recorded_writes_no_trace_and_says_so(procs, runs_dir, tmp_path):
    profile = paced_profile(tmp_path, max_steps=1_000_000)
    procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                env=cli_env(PACE_S="0.02"), cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    # Read at consecutive steps: the stop comes right after the warmup step.
    cid = append_control(run, "profile", steps=5)
    append_control(run, "stop")
    wait_for(lambda: read_status(run).get("state") == "stopped", what="the run stopped")
    rejected = _ack(run, cid, "rejected")
    assert rejected["reason"] == "profile: no trace written (stop before a step was recorded)"
    assert rejected["steps"] == 0 and events_of(run, "profile") == []
    assert list((run / "profiles").glob("*/*")) == []

    # RUN resolves as checkpoint's and stop's: an ended run, an unknown one: one line, exit 2.
    rd = ["--runs-dir", str(runs_dir)]
    ended = procs.cli("profile", run.name, *rd, cwd=tmp_path)
    assert ended.returncode == 2 and ended.stderr.strip().splitlines() == [
        f"gpu-console: {run}: the run has already ended (state stopped)"
    ]
    ghost = procs.cli("profile", "ghost", *rd, cwd=tmp_path)
    assert ghost.returncode == 2 and len(ghost.stderr.strip().splitlines()) == 1, ghost.stderr
