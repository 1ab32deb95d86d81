"""Bad numbers and a full disk. The nan policy's stop on the engine harness
(tests/harness.py), the full disk through real torchrun (the supervisor's reserve); 2 CPU
ranks each.
"""

from __future__ import annotations

import os
import re
import signal

import torch
from conftest import (
    POISONED_TASK,
    deadline,
    events_of,
    only_run,
    read_status,
    run_dirs,
    task_profile,
    wait_for,
)
from harness import run_engine
from headless_text import headless_text


def test_nan_policy_stop_checkpoints_the_last_finite_state_then_fails(runs_dir, tmp_path):
    # Rank 1's loss turns nan in its 5th batch: every rank stops at the same step.
    profile = task_profile(tmp_path, "poisoned", POISONED_TASK, "Poisoned", max_steps=12, ranks=2)
    # The ranks exit 0 so that torchrun would not restart them (a rank that exits otherwise
    # is raised here): the engine fails the run in its status, which the supervisor records
    # (the run's exit code 1, DESIGN.md, whatever torchrun's own).
    run = run_engine(
        tmp_path,
        profile,
        "train.nan_policy=stop",
        "train.log_every=3",  # the check is per step, not per log interval
        ranks=2,
        runs_dir=runs_dir,
    )
    assert run == only_run(runs_dir)
    status = events_of(run, "status")[-1]
    assert status["state"] == "failed", status
    assert "loss is nan in step 5 (train.nan_policy = 'stop')" in status["reason"], status
    assert "checkpoint step-00000004 holds the last finite state" in status["reason"], status
    assert "loss is nan in step 5" in headless_text(run)

    # The checkpoint is the state after step 4, before the poisoned update: every number in
    # it is finite, and LATEST names it.
    ckpt = events_of(run, "checkpoint")[-1]
    assert (ckpt["step"], ckpt["reason"]) == (4, "nan")
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000004"
    state = torch.load(run / "checkpoints" / "step-00000004" / "state.pt", weights_only=True)
    assert state["step"] == 4
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values()]
    assert all(torch.isfinite(t).all() for t in moments if isinstance(t, torch.Tensor))
    # No step 5 was ever taken, and no event shows a non-finite loss.
    assert max(e["step"] for e in events_of(run, "step")) == 3


# torch.save fails the way a full disk makes it fail, from the second checkpoint on, after
# writing part of the file. The module is imported by every rank (it is the run's task), so
# the patch is in the ranks' own processes; rank 0 is the only one that saves.
FULL_DISK_TASK = """
import errno
import os
import torch
from gpu_console.tasks.mlp import MLPTask

_save = torch.save
saves = 0


def save_on_a_full_disk(obj, f, *args, **kwargs):
    global saves
    # A checkpoint's file (the file checkpoint.py opened); gather_object pickles through
    # torch.save too, into a buffer.
    if not isinstance(getattr(f, "name", None), (str, os.PathLike)):
        return _save(obj, f, *args, **kwargs)
    saves += 1
    if saves >= 2:
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")
    return _save(obj, f, *args, **kwargs)


# A rank's process only: the launch imports the task in its own to check it (the
# harness: in the pytest worker, which must not keep the patch for later tests).
if "RANK" in os.environ:
    torch.save = save_on_a_full_disk


class FullDisk(MLPTask):
    pass
"""


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(procs, runs_dir, tmp_path):
    profile = task_profile(
        tmp_path,
        "fulldisk",
        FULL_DISK_TASK,
        "FullDisk",
        max_steps=1_000_000,
        extra="[checkpoint]\nevery_steps = 5\n",
    )
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")

    def failed_saves():
        return [e for e in events_of(run, "log") if e.get("checkpoint_failed")]

    wait_for(lambda: len(failed_saves()) >= 2, what="two checkpoints that could not be written")
    first = failed_saves()[0]
    assert first["level"] == "error"
    assert first["checkpoint_failed"]["step"] == 10
    # One line, naming the disk and its free space (a real one: the errno is all the fake's).
    assert re.fullmatch(
        r"checkpoint @ step 10 \(interval\) not written: no space left on /\S* "
        r"\([\d.]+ \w+ free\); LATEST stays at step-00000005",
        first["message"],
    ), first["message"]
    # The run went on training after it.
    wait_for(lambda: events_of(run, "step")[-1]["step"] > 12, what="training on")

    # A stop now cannot write its checkpoint either: the run ends as interrupted (exit 130),
    # and LATEST still names the complete step-5 checkpoint.
    os.kill(read_status(run)["pids"]["supervisor"], signal.SIGTERM)
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 130, out + err
    final = read_status(run)
    assert final["state"] == "stopped" and final["checkpointed_on_stop"] is False
    assert final["checkpoint_failed"]["reason"] == "signal"
    assert final["checkpoint_failed"]["latest"] == "step-00000005"
    assert "no space left on " in out and "LATEST is step-00000005" in out
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step-00000005"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LATEST", "step-00000005"]  # no debris
    state = torch.load(ckpts / "step-00000005" / "state.pt", weights_only=True)
    assert state["step"] == 5
