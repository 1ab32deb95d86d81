"""Checkpoint writing and the other ranks, on 2 CPU ranks: a slow write on the engine harness
(tests/harness.py), a failed one on two nodes through real torchrun.

While rank 0 writes, the others wait for its outcome on a group of their own whose timeout
no write outlasts, not in the next training collective (``distributed.collective_timeout_s``);
and every rank, on every node, learns whether the write succeeded.
"""

from __future__ import annotations

import torch
from conftest import (
    deadline,
    events_of,
    only_run,
    read_status,
    run_dirs,
    start_nodes,
    task_profile,
    wait_for,
)
from harness import run_engine
from test_survive_data import FULL_DISK_TASK

from gpu_console.events import append_control

TIMEOUT_S = 3.0
SLOW_S = 10.0

# A disk far slower than the collective timeout: rank 0's first checkpoint write takes SLOW_S
# seconds. The module is the run's task, so the patch is in the ranks' own processes.
SLOW_DISK_TASK = f"""
import os
import time
import torch
from gpu_console.tasks.mlp import MLPTask

_save = torch.save
writes = 0


def slow_save(obj, f, *args, **kwargs):
    global writes
    # A checkpoint's file (a path, or the file it opened); gather_object pickles through
    # torch.save too, into a buffer.
    if isinstance(getattr(f, "name", f), (str, os.PathLike)):
        writes += 1
        if writes == 1:
            time.sleep({SLOW_S})
    return _save(obj, f, *args, **kwargs)


# A rank's process only: the launch imports the task in its own to check it (the
# harness: in the pytest worker, which must not keep the patch for later tests).
if "RANK" in os.environ:
    torch.save = slow_save


class SlowDisk(MLPTask):
    pass
"""


def test_a_write_slower_than_the_collective_timeout_does_not_end_the_run(runs_dir, tmp_path):
    profile = task_profile(
        tmp_path,
        "slowdisk",
        SLOW_DISK_TASK,
        "SlowDisk",
        max_steps=8,
        extra=(
            f"[distributed]\ncollective_timeout_s = {TIMEOUT_S}\n[checkpoint]\nevery_steps = 4\n"
        ),
        ranks=2,
    )
    run = run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir)  # the ranks' own waits
    assert events_of(run, "status")[-1]["state"] == "finished"
    first, last = events_of(run, "checkpoint")
    assert (first["step"], last["step"]) == (4, 8)
    assert first["seconds"] >= SLOW_S > 3 * TIMEOUT_S
    assert [e["step"] for e in events_of(run, "step")] == list(range(1, 9))  # every one after it
    state = torch.load(run / "checkpoints" / "step-00000008" / "state.pt", weights_only=True)
    assert state["step"] == 8


def test_every_node_learns_that_rank_0s_write_failed(procs, runs_dir, tmp_path):
    # Two "nodes" on this machine, one rank each, each node with its own runs directory: the
    # node without rank 0 writes no checkpoint, yet its status must say the stop's failed.
    profile = task_profile(
        tmp_path,
        "fulldisk",
        FULL_DISK_TASK,
        "FullDisk",
        max_steps=1_000_000,
        extra="[checkpoint]\nevery_steps = 5\n",
    )
    dirs = [runs_dir / "node0", runs_dir / "node1"]
    consoles, _ = start_nodes(procs, profile, dirs, cwd=tmp_path)
    runs = [wait_for(lambda d=d: run_dirs(d) and only_run(d), what="a run directory") for d in dirs]

    def failed(run):
        return [e["checkpoint_failed"] for e in events_of(run, "log") if e.get("checkpoint_failed")]

    wait_for(lambda: all(failed(r) for r in runs), what="a failed checkpoint on both nodes")
    for run in runs:
        first = failed(run)[0]
        assert first["error"].startswith("no space left on "), first
        assert {k: first[k] for k in ("step", "reason", "latest")} == {
            "step": 10,
            "reason": "interval",
            "latest": "step-00000005",
        }
    append_control(runs[0], "stop")
    for console in consoles:
        out, err = console.communicate(timeout=deadline(120))
        assert console.returncode == 130, out + err  # a stop without its checkpoint
        assert "LATEST is step-00000005" in out
    for run in runs:
        final = read_status(run)
        assert final["state"] == "stopped" and final["checkpointed_on_stop"] is False
        assert final["checkpoint_failed"]["reason"] == "stop"
        stopped = [e for e in events_of(run, "status") if e["state"] == "stopped"]
        assert stopped[-1]["checkpointed"] is False
