"""Control of a live run through real torchrun: commands, signals, a crashing rank, output."""

from __future__ import annotations

import os
import signal
import textwrap

from conftest import (
    HANGING_TASK,
    POISONED_TASK,
    deadline,
    events_of,
    fast_profile,
    only_run,
    pid_alive,
    read_status,
    task_profile,
    the_run,
    wait_for,
)
from harness import run_engine

from gpu_console.events import append_control


def _start_long(procs, runs_dir, tmp_path, *args, ranks: int = 1):
    profile = fast_profile(tmp_path, max_steps=1_000_000, ranks=ranks)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir), *args)
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a first step")
    return console, run


def _acks(run, cid):
    return [e["state"] for e in events_of(run, "control") if e["id"] == cid]


def test_checkpoint_pause_resume_and_stop_through_the_control_file(procs, runs_dir, tmp_path):
    # Two ranks: each command is read by rank 0 and must reach the other rank's loop.
    console, run = _start_long(procs, runs_dir, tmp_path, ranks=2)

    cid = append_control(run, "checkpoint")
    wait_for(lambda: _acks(run, cid) == ["received", "done"], what="checkpoint acknowledged")
    requested = [c for c in events_of(run, "checkpoint") if c["reason"] == "request"]
    assert len(requested) == 1
    assert (
        run / "checkpoints" / "LATEST"
    ).read_text().strip() == f"step-{requested[0]['step']:08d}"

    cid = append_control(run, "pause")
    wait_for(lambda: _acks(run, cid) == ["received", "done"], what="pause acknowledged")
    assert events_of(run, "status")[-1]["state"] == "paused"
    paused_at = [e for e in events_of(run, "control") if e["id"] == cid][0]["step"]
    # While paused, commands are still served, and no step is taken: a checkpoint taken now
    # is at the step where the run paused, and no step event came after it.
    cid = append_control(run, "checkpoint")
    wait_for(lambda: _acks(run, cid) == ["received", "done"], what="checkpoint while paused")
    assert events_of(run, "checkpoint")[-1]["step"] == paused_at
    assert events_of(run, "step")[-1]["step"] <= paused_at
    wait_for(lambda: read_status(run).get("state") == "paused", what="status.json paused")

    cid = append_control(run, "resume")
    wait_for(lambda: _acks(run, cid) == ["received", "done"], what="resume acknowledged")
    wait_for(lambda: events_of(run, "step")[-1]["step"] > paused_at + 5, what="steps again")

    cid = append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    assert _acks(run, cid) == ["received", "done"]
    assert [c["reason"] for c in events_of(run, "checkpoint")][-1] == "stop"
    assert read_status(run)["state"] == "stopped"


def test_sigterm_to_the_supervisor_checkpoints_with_reason_signal(procs, runs_dir, tmp_path):
    console, run = _start_long(procs, runs_dir, tmp_path)
    status = read_status(run)
    os.kill(status["pids"]["supervisor"], signal.SIGTERM)
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    final = read_status(run)
    assert final["state"] == "stopped" and final["reason"] == "signal"
    assert events_of(run, "checkpoint")[-1]["reason"] == "signal"
    assert not any(pid_alive(p) for p in [status["pids"]["torchrun"], *status["pids"]["workers"]])


CRASHING_TASK = """
import os
from gpu_console.tasks.mlp import MLPTask


class Crashing(MLPTask):
    calls = 0

    def compute(self, model, batch):
        Crashing.calls += 1
        if os.environ["RANK"] == "1" and Crashing.calls == 6:
            raise RuntimeError("rank one broke on purpose")
        return super().compute(model, batch)
"""


def test_a_crashing_rank_fails_the_run_and_is_named_with_its_traceback(procs, runs_dir, tmp_path):
    (tmp_path / "crashing.py").write_text(textwrap.dedent(CRASHING_TASK))
    profile = fast_profile(tmp_path, max_steps=1_000_000, ranks=2)
    text = profile.read_text().replace('kind = "mlp"', 'kind = "crashing:Crashing"')
    profile.write_text(text)
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    run = only_run(runs_dir)
    status = read_status(run)
    assert status["state"] == "failed"
    failure = status["failure"]
    assert failure["rank"] == 1
    assert "rank one broke on purpose" in failure["summary"]
    assert "crashing.py" in failure["traceback"]
    assert "rank 1 failed" in result.stdout and "rank one broke on purpose" in result.stdout
    assert events_of(run, "status")[-1]["state"] == "failed"


def test_plain_output_off_a_terminal_has_no_carriage_returns(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=150, ranks=2)
    result = procs.cli(
        "run",
        str(profile),
        "--headless",
        "--runs-dir",
        str(runs_dir),
        "--set",
        "train.log_every=10",
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout and "\x1b[" not in result.stdout
    assert "started: 2 × cpu ranks, fp32" in result.stdout
    assert "finished (max_steps reached)" in result.stdout
    assert "final loss" in result.stdout and "peak memory rank 1" in result.stdout


def test_bf16_autocast_runs_on_cpu(tmp_path):
    # The engine's part (the harness, one rank in this process): the console's is below.
    run = run_engine(tmp_path, fast_profile(tmp_path, max_steps=20), "train.precision=bf16")
    assert events_of(run, "start")[0]["precision"] == "bf16"
    steps = events_of(run, "step")
    assert steps[-1]["step"] == 20 and steps[-1]["loss"] < steps[0]["loss"]


def test_lr_scaling_and_global_batch_follow_the_world_size(tmp_path):
    profile = fast_profile(tmp_path, max_steps=2, ranks=2)
    run = run_engine(tmp_path, profile, "distributed.lr_scaling=linear", "train.grad_accum=3",
                     ranks=2)  # fmt: skip
    start = events_of(run, "start")[0]
    assert start["lr"] == 2 * 3e-3
    assert start["global_batch"] == 32 * 3 * 2


def _poisoned(tmp_path):
    return task_profile(tmp_path, "poisoned", POISONED_TASK, "Poisoned", max_steps=12, ranks=2)


def test_nan_policy_skip_skips_the_poisoned_updates_and_carries_on(tmp_path):
    run = run_engine(tmp_path, _poisoned(tmp_path), "train.nan_policy=skip", ranks=2)
    steps = events_of(run, "step")
    assert [s["skipped"] for s in steps] == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert all(s["loss"] == s["loss"] for s in steps[6:])  # finite again: weights not poisoned
    assert events_of(run, "status")[-1]["state"] == "finished"


def test_nan_policy_stop_fails_the_run_naming_the_step(tmp_path):
    # The engine records the failure (no exception leaves it); the supervisor takes the
    # reason as the failure's summary.
    run = run_engine(tmp_path, _poisoned(tmp_path), "train.nan_policy=stop", ranks=2)
    ended = events_of(run, "status")[-1]
    assert ended["state"] == "failed"
    assert "loss is nan in step 5" in ended["reason"]


def test_status_lists_ranks_not_their_dataloader_workers(procs, runs_dir, tmp_path):
    console, run = _start_long(procs, runs_dir, tmp_path, "--set", "data.num_workers=2", ranks=2)
    status = wait_for(
        lambda: (s := read_status(run)) and len(s["pids"].get("workers") or []) == 2 and s,
        what="two rank pids",
    )
    import psutil

    for pid in status["pids"]["workers"]:
        assert psutil.Process(pid).ppid() == status["pids"]["torchrun"]
        # Each rank really has its two loader processes under it, and they are not listed.
        wait_for(lambda pid=pid: len(psutil.Process(pid).children()) >= 2, what="loaders")
    append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err


def _hung_run(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "hanging", HANGING_TASK, "Hanging", max_steps=1000, ranks=2)
    out = open(tmp_path / "console.out", "w")  # noqa: SIM115 - the console writes it
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path, stdout=out
    )
    out.close()
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 5, what="five steps, then the hang")
    status = wait_for(
        lambda: (s := read_status(run)) and len(s["pids"].get("workers") or []) == 2 and s,
        what="worker pids",
    )
    console.send_signal(signal.SIGINT)
    wait_for(lambda: '"stop"' in (run / "control.jsonl").read_text(), what="the stop command")
    return console, run, status


def _printed(tmp_path) -> str:
    return (tmp_path / "console.out").read_text()


def _run_pids(status):
    return [status["pids"]["torchrun"], *status["pids"]["workers"]]


def test_third_ctrl_c_kills_the_run_at_once(procs, runs_dir, tmp_path):
    console, run, status = _hung_run(procs, runs_dir, tmp_path)
    console.send_signal(signal.SIGINT)
    # Pending signals of one kind merge: send the third only once the second took effect.
    wait_for(lambda: "interrupting" in _printed(tmp_path), what="the second Ctrl-C's effect")
    console.send_signal(signal.SIGINT)
    wait_for(
        lambda: not any(pid_alive(p) for p in _run_pids(status)),
        timeout=30,
        what="the run's processes to be killed",
    )
    _, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 130, _printed(tmp_path) + err
    assert "killed" in _printed(tmp_path)
