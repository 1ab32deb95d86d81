"""Crashed ranks, restarts and running out of memory, through real torchrun on 2 CPU ranks."""

from __future__ import annotations

import os
import signal
import time

from conftest import (
    deadline,
    events_of,
    fast_profile,
    only_run,
    pid_alive,
    read_status,
    run_dirs,
    task_profile,
    wait_for,
)

from gpu_console.state import read_heartbeats

RANK_0_HANGS = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class RankZeroHangs(MLPTask):
    calls = 0

    def compute(self, model, batch):
        RankZeroHangs.calls += 1
        if os.environ["RANK"] == "0" and RankZeroHangs.calls == 8:
            time.sleep(600)  # stuck outside any collective: it will never notice a dead peer
        return super().compute(model, batch)
"""


def _beat(run, rank) -> dict:
    return next((b for b in read_heartbeats(run) if b["rank"] == rank), {})


def test_kill_9_of_a_rank_fails_the_run_in_seconds_even_with_a_stuck_peer(
    procs, runs_dir, tmp_path
):
    """The peer is stuck where no collective error reaches it (on GPUs: NCCL waits for its
    timeout); the supervisor sees rank 1 die without ending cleanly and ends the peer."""
    profile = task_profile(
        tmp_path, "hangs", RANK_0_HANGS, "RankZeroHangs", max_steps=1000, ranks=2
    )
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    wait_for(
        lambda: _beat(run, 0).get("phase") == "compute" and _beat(run, 0).get("step") == 8,
        what="rank 0 stuck in step 8",
    )
    status = read_status(run)
    pids = [status["pids"]["torchrun"], *status["pids"]["workers"]]
    killed = time.monotonic()
    os.kill(_beat(run, 1)["pid"], signal.SIGKILL)
    final = wait_for(lambda: (s := read_status(run)).get("ended") and s, 30, "the run's end")
    took = time.monotonic() - killed
    # ~3 s when idle (2 s of it the peers' grace); without the reap torchrun would wait its
    # 30 s shutdown grace for the stuck rank. The margin is for a loaded machine.
    assert took < 15.0, f"failed after {took:.1f}s"
    assert final["state"] == "failed"
    assert final["failure"]["rank"] == 1
    assert final["failure"]["summary"] == "rank 1 exited with code -9 (killed by SIGKILL)"
    assert not any(pid_alive(p) for p in pids)
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 1, out + err
    assert "rank 1 exited with code -9 (killed by SIGKILL)" in out


RANK_1_KILLED_ONCE = """
import os
import signal
from gpu_console.tasks.mlp import MLPTask


class RankOneKilledOnce(MLPTask):
    calls = 0

    def compute(self, model, batch):
        RankOneKilledOnce.calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if os.environ["RANK"] == "1" and first_attempt and RankOneKilledOnce.calls == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().compute(model, batch)
"""


def test_max_restarts_restarts_the_group_and_resumes_from_latest(procs, runs_dir, tmp_path):
    # The rank kills itself in step 8, past the checkpoint of step 5, so the test does not
    # race a run that on a fast machine can end before an outside kill lands. The write is
    # synchronous, so step 5 is on disk by then (a crash during a background write loses
    # that write: test_checkpoint_async's kill -9).
    profile = task_profile(
        tmp_path,
        "killed",
        RANK_1_KILLED_ONCE,
        "RankOneKilledOnce",
        max_steps=40,
        extra="[distributed]\nmax_restarts = 1\n[checkpoint]\nevery_steps = 5\nkeep_last = 0\n"
        "async_write = false\n",
        ranks=2,
    )
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")

    out, err = console.communicate(timeout=deadline(180))
    assert console.returncode == 0, out + err
    final = read_status(run)
    assert final["state"] == "finished" and final["restarts"] == 1
    starts = events_of(run, "start")
    assert [s["restart"] for s in starts] == [0, 1]
    resumed = starts[1]["start_step"]
    assert resumed == 5
    assert starts[1]["resumed_from"].endswith(f"step-{resumed:08d}")
    # The restarted group carries on from the checkpoint, to the end.
    after = [e["step"] for e in events_of(run, "step") if e["t"] >= starts[1]["t"]]
    assert after == list(range(resumed + 1, 41))
    assert "restarting" in [e["state"] for e in events_of(run, "status")]
    assert f"restart 1 of 1: torchrun restarted the ranks; resumed from step {resumed}" in out
    assert "restarts" in out and "1 of 1" in out


OOM_TASK = """
import os
import torch
from gpu_console.tasks.mlp import MLPTask


class OutOfMemory(MLPTask):
    calls = 0

    def compute(self, model, batch):
        OutOfMemory.calls += 1
        if os.environ["RANK"] == "1" and OutOfMemory.calls == 4:
            # What the CUDA caching allocator raises; there is no GPU here to fill.
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a total capacity "
                "of 79.25 GiB of which 1.05 GiB is free."
            )
        return super().compute(model, batch)
"""


def test_out_of_memory_ends_every_rank_with_the_peak_and_what_to_change(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "oom", OOM_TASK, "OutOfMemory", max_steps=1000, ranks=2)
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    run = only_run(runs_dir)
    final = read_status(run)
    failure = final["failure"]
    assert failure["rank"] == 1 and failure["exit_code"] == 1
    assert "raise torch.cuda.OutOfMemoryError" in failure["traceback"]
    summary = failure["summary"]
    assert summary.startswith(
        "rank 1 failed: OutOfMemory: rank 1 ran out of memory on cpu in step 4"
    )
    assert "Tried to allocate 20.00 GiB" in summary
    assert "; peak " in summary and "GiB" in summary
    for advice in ("data.batch_size (now 32)", "train.grad_accum (now 1)", "train.precision"):
        assert advice in summary
    assert "activation checkpointing" in summary
    assert "ran out of memory" in result.stdout
    # Every rank ended (rank 0 saw its peer go; nothing is left holding memory).
    phases = {b["rank"]: b["phase"] for b in read_heartbeats(run)}
    assert phases[1] == "failed" and phases[0] != "done"
    assert not any(pid_alive(b["pid"]) for b in read_heartbeats(run))


def test_the_engine_ignores_a_control_file_it_does_not_own(procs, runs_dir, tmp_path):
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to give the control file to another user")
    from gpu_console.events import append_control

    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a first step")
    control = run / "control.jsonl"
    os.chown(control, 65534, 65534)  # nobody's now
    foreign = append_control(run, "stop")
    wait_for(
        lambda: any("not owned" in e["message"] for e in events_of(run, "log")),
        what="the engine to notice the foreign control file",
    )
    seen = events_of(run, "step")[-1]["step"]
    wait_for(lambda: events_of(run, "step")[-1]["step"] > seen + 20, what="training on")
    assert not [e for e in events_of(run, "control") if e["id"] == foreign]
    os.chown(control, os.getuid(), os.getgid())
    mine = append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    acks = [e["state"] for e in events_of(run, "control") if e["id"] == mine]
    assert acks == ["received", "done"]
    assert not [e for e in events_of(run, "control") if e["id"] == foreign]  # never, not late


def test_no_shell_strings_anywhere_in_the_package():
    from pathlib import Path

    import gpu_console

    root = Path(gpu_console.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "shell=True" in p.read_text() or "os.system(" in p.read_text()
    ]
    assert offenders == []
