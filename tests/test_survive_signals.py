"""Runs that survive a closed terminal and a scheduler's signals, through real processes.

Every test starts the real CLI (console → supervisor → torchrun → 2 CPU ranks on gloo),
signals one or several of those processes as SSH, tmux, SLURM or Kubernetes would, and
waits on what the run directory says.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import conftest
import pytest
from conftest import (
    HANGING_TASK,
    deadline,
    events_of,
    fast_profile,
    only_run,
    paced_profile,
    pid_alive,
    read_status,
    run_dirs,
    task_profile,
    wait_for,
)


def _start(procs, runs_dir, tmp_path, *args, max_steps=1_000_000, extra="", ranks=1, **kw):
    profile = fast_profile(tmp_path, max_steps=max_steps, extra=extra, ranks=ranks)
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), *args, **kw
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a first step")
    status = wait_for(
        lambda: (s := read_status(run)) and len(s["pids"].get("workers") or []) == ranks and s,
        what=f"{ranks} worker pids in status.json",
    )
    return console, run, status


def _run_pids(status) -> list[int]:
    return [status["pids"]["supervisor"], status["pids"]["torchrun"], *status["pids"]["workers"]]


def _stopped_by_signal(run, console, status):
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    final = read_status(run)
    assert final["state"] == "stopped" and final["reason"] == "signal", final
    assert final["checkpointed_on_stop"] is True
    ckpt = events_of(run, "checkpoint")[-1]
    assert ckpt["reason"] == "signal"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step-{ckpt['step']:08d}"
    wait_for(lambda: not any(pid_alive(p) for p in _run_pids(status)), 30, "the run's processes")
    return final, out


# -- the terminal goes away ---------------------------------------------------------------


def test_hanging_up_the_console_terminal_never_stops_training(procs, runs_dir, tmp_path):
    """The console runs on a pseudo-terminal as in an SSH session; closing it sends SIGHUP."""
    # 300 steps of 20 ms, paced while `pace` exists: the hang-up is early; then full speed.
    profile = paced_profile(tmp_path, max_steps=300)
    pace = tmp_path / "pace"
    pace.touch()
    master, slave = pty.openpty()

    def controlling_terminal() -> None:  # a session of its own, the pty as its terminal
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a login shell (not under nohup)

    console = subprocess.Popen(
        [sys.executable, "-m", "gpu_console", "run", str(profile), "--headless"]
        + ["--runs-dir", str(runs_dir)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=controlling_terminal,
        env=conftest.test_env(PACE_S="0.02", PACE_WHILE=str(pace)),
        cwd=tmp_path,
    )
    procs.started.append(console)
    os.close(slave)
    seen = bytearray()

    def drain() -> None:  # the console's terminal output must be read, or it blocks
        while select.select([master], [], [], 0)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    def reporting():  # the console really is reporting the run on this terminal
        drain()
        return b"started: 1" in seen and events_of(only_run(runs_dir), "step")

    wait_for(reporting, what="the console to report a first step")
    run = only_run(runs_dir)
    hung_up_at = events_of(run, "step")[-1]["step"]
    assert hung_up_at < 300
    os.close(master)  # the SSH connection drops
    assert console.wait(timeout=60) == -signal.SIGHUP
    pace.unlink()  # the console is gone: the run trains on to its end at full speed

    final = wait_for(lambda: (s := read_status(run)).get("ended") and s, what="the run's end")
    assert final["state"] == "finished" and final["exit_code"] == 0
    # A later reader sees the whole history: every step, before and after the hang-up.
    assert [e["step"] for e in events_of(run, "step")] == list(range(1, 301))
    assert [e["state"] for e in events_of(run, "status")] == ["starting", "running", "finished"]
    rows = procs.cli("ls", "--json", "--runs-dir", str(runs_dir))
    assert '"state": "finished"' in rows.stdout and '"step": 300' in rows.stdout


def test_a_warning_while_the_console_still_launches_stops_the_run_at_its_first_step(
    procs, runs_dir, tmp_path
):
    """SLURM's warning the moment the run directory appears: the console is writing the run
    and starting its supervisor, nothing has a handler yet. It was held (held_signals.py):
    the run takes its first step, checkpoints and stops, as for any scheduler signal."""
    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    wait_for(lambda: runs_dir.is_dir() and any(runs_dir.iterdir()), what="the run directory")
    console.send_signal(signal.SIGUSR1)
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err  # not killed by the signal's default action
    run = only_run(runs_dir)
    final = read_status(run)
    assert final["state"] == "stopped" and final["reason"] == "signal", final
    assert final["checkpointed_on_stop"] and final["torchrun_exit"] == 0, final
    assert events_of(run, "checkpoint")[-1]["reason"] == "signal"
    assert "SIGUSR1: stopping the run at the next step with a checkpoint" in out


def test_sigterm_to_the_headless_console_stops_the_run_with_a_checkpoint(procs, runs_dir, tmp_path):
    # A batch script's `gpu-console run --headless` is what `scancel --batch` signals.
    console, run, status = _start(procs, runs_dir, tmp_path)
    console.send_signal(signal.SIGTERM)
    _, out = _stopped_by_signal(run, console, status)
    assert "SIGTERM: stopping the run at the next step with a checkpoint" in out


# -- schedulers ---------------------------------------------------------------------------


def test_sigterm_to_torchrun_checkpoints_with_reason_signal(procs, runs_dir, tmp_path):
    console, run, status = _start(procs, runs_dir, tmp_path, ranks=2)
    sent = time.monotonic()
    os.kill(status["pids"]["torchrun"], signal.SIGTERM)
    _stopped_by_signal(run, console, status)
    assert time.monotonic() - sent < 30  # the profile's grace period
    # torchrun's own exit status is 1 (it re-raises the signal); the run was stopped cleanly,
    # and its exit code says so (DESIGN.md: 0, stopped with its checkpoint).
    assert read_status(run)["exit_code"] == 0 and read_status(run)["torchrun_exit"] == 1


def _blocked(pid: int) -> int:
    """The process's blocked-signal mask (/proc's SigBlk)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigBlk")


def test_sigusr1_is_held_by_torchrun_and_let_through_by_every_rank(procs, runs_dir, tmp_path):
    # SIGUSR1's default action kills, and torchrun's own handler ends the ranks: torchrun
    # holds it for its life (held_signals.py). The scheduler's warning reaches the ranks and
    # the supervisor themselves (SLURM signals every process of the step).
    console, run, status = _start(procs, runs_dir, tmp_path, ranks=2)
    usr1 = 1 << (signal.SIGUSR1 - 1)
    torchrun = status["pids"]["torchrun"]
    assert _blocked(torchrun) & usr1
    for pid in [status["pids"]["supervisor"], *status["pids"]["workers"]]:
        assert not _blocked(pid) & usr1, pid
    at = events_of(run, "step")[-1]["step"]
    os.kill(torchrun, signal.SIGUSR1)
    wait_for(lambda: events_of(run, "step")[-1]["step"] >= at + 3, what="training on")
    assert pid_alive(torchrun)
    assert not [c for c in events_of(run, "checkpoint") if c["reason"] == "signal"]
    for pid in status["pids"]["workers"]:  # the warning as SLURM sends it: to each
        os.kill(pid, signal.SIGUSR1)
    _stopped_by_signal(run, console, status)


def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(procs, runs_dir, tmp_path):
    console, run, status = _start(procs, runs_dir, tmp_path, ranks=2)
    os.kill(status["pids"]["workers"][1], signal.SIGTERM)
    final, _ = _stopped_by_signal(run, console, status)
    assert final["exit_code"] == 0
    # Both ranks ended cleanly at the step of the signal checkpoint.
    ckpt = events_of(run, "checkpoint")[-1]
    from gpu_console.state import read_heartbeats

    beats = read_heartbeats(run)
    assert sorted((b["rank"], b["phase"], b["step"]) for b in beats) == [
        (0, "done", ckpt["step"]),
        (1, "done", ckpt["step"]),
    ]


def test_a_signal_to_every_process_of_the_job_at_once_is_one_graceful_stop(
    procs, runs_dir, tmp_path
):
    """`scancel`, systemd or a container runtime signal the whole process tree together."""
    console, run, status = _start(procs, runs_dir, tmp_path, ranks=2)
    for pid in [console.pid, *_run_pids(status)]:
        os.kill(pid, signal.SIGTERM)
    final, _ = _stopped_by_signal(run, console, status)
    assert len([c for c in events_of(run, "checkpoint") if c["reason"] == "signal"]) == 1


def test_a_stray_signal_that_kills_torchrun_leaves_no_worker(procs, runs_dir, tmp_path):
    console, run, status = _start(procs, runs_dir, tmp_path)
    os.kill(status["pids"]["torchrun"], signal.SIGUSR2)  # not handled by torchrun: fatal
    wait_for(lambda: not any(pid_alive(p) for p in _run_pids(status)), 30, "every process gone")
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 1, out + err
    final = read_status(run)
    assert final["state"] == "failed"
    assert final["failure"]["summary"] == "torchrun was killed by SIGUSR2"
    assert "torchrun was killed by SIGUSR2" in out


@pytest.mark.parametrize("torchrun_has", ["as installed", "no --shutdown-timeout"])
def test_ranks_that_cannot_stop_are_killed_after_the_profiles_grace(
    procs, runs_dir, tmp_path, monkeypatch, torchrun_has
):
    # The SIGTERM→SIGKILL window after torchrun is signalled is the profile's shutdown_grace_s
    # (default 30 s, also torchrun's default), whatever the torchrun: passed as
    # --shutdown-timeout where torchrun has it, enforced by the supervisor where it has not
    # (torch 2.11). With 3 s, ranks stuck in a step are killed after about 3 s.
    from gpu_console import torchrun

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if torchrun_has == "no --shutdown-timeout":
        # The detection's answer, as a torchrun without the flag gives it (any torch).
        options = torchrun.ask_parser()
        options.pop("shutdown_timeout", None)
        identity = torchrun.torch_identity()
        torchrun._write_cache(torchrun._cache_file(identity), identity, options)
    profile = task_profile(
        tmp_path,
        "hanging",
        HANGING_TASK,
        "Hanging",
        extra="[distributed]\nshutdown_grace_s = 3.0\n",
    )
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    meta_file = wait_for(lambda: (f := run / "meta.json").is_file() and f, what="meta.json")
    meta = json.loads(meta_file.read_text())
    has_flag = "--shutdown-timeout=3" in meta["torchrun"]
    assert has_flag != ("--shutdown-timeout" in meta["torchrun_compat"]["dropped"])
    if torchrun_has == "no --shutdown-timeout":
        assert not has_flag
    _assert_grace_enforced(run, console)


def _assert_grace_enforced(run, console):
    wait_for(lambda: len(events_of(run, "step")) >= 5, what="five steps, then the hang")
    status = read_status(run)
    sent = time.monotonic()
    os.kill(status["pids"]["torchrun"], signal.SIGTERM)
    final = wait_for(lambda: (s := read_status(run)).get("ended") and s, 60, "the run's end")
    assert time.monotonic() - sent < 20  # 3 s of grace, not torchrun's default 30 s
    assert final["state"] == "stopped"
    assert final["reason"] == "terminated before a checkpoint (torchrun got SIGTERM)"
    assert final["checkpointed_on_stop"] is False
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 130, out + err
    assert not any(pid_alive(p) for p in _run_pids(status))


def test_signals_together_are_one_request_and_a_late_one_escalates(monkeypatch):
    from gpu_console.engine import signals

    exits: list[int] = []
    clock = [1000.0]
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    signals.reset()
    try:
        signals._on_signal(signal.SIGTERM, None)  # the scheduler
        clock[0] += 0.1
        signals._on_signal(signal.SIGTERM, None)  # torchrun forwarding it
        signals._on_signal(signal.SIGUSR1, None)  # the supervisor
        assert signals.signalled() and exits == []
        clock[0] += signals.COALESCE_S + 1
        signals._on_signal(signal.SIGUSR1, None)  # a warning again: the same request
        assert exits == []
        signals._on_signal(signal.SIGTERM, None)  # the graceful stop is stuck: leave now
        assert exits == [128 + signal.SIGTERM]
        signals.reset()
        signals.stopping()  # a control-file stop under way
        clock[0] += signals.COALESCE_S + 1
        signals._on_signal(signal.SIGTERM, None)
        assert exits == [128 + signal.SIGTERM] * 2
    finally:
        signals.reset()
