"""Soak: kill -9 at random moments, and nothing is ever lost (run on demand: -m slow).

Rounds of real runs (console → supervisor → torchrun → 2 CPU ranks) that checkpoint every
few steps, with a model large enough that a checkpoint takes a while to write; rounds
alternate background writes (``checkpoint.async_write = true``: rank 0's writer thread is
killed mid-write while training goes on) and synchronous ones. Each round
kills processes of the run with SIGKILL at random moments: a rank (torchrun restarts the
group while ``max_restarts`` allows), rank 0 while it writes a checkpoint, the torchrun
agent, the supervisor, or the console. After every kill:

- LATEST, where it exists, names a complete checkpoint that loads with weights_only=True;
- once the run has ended (or lost its supervisor), no process of the run is alive.

``GPU_CONSOLE_SOAK_KILLS`` sets how many kills (default 40), ``GPU_CONSOLE_SOAK_SEED`` the
seed (default: random, printed). Run: ``python -m pytest -m slow tests/test_soak.py -s``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import (
    deadline,
    events_of,
    fast_profile,
    only_run,
    pid_alive,
    read_status,
    run_dirs,
    wait_for,
)

from gpu_console.state import read_heartbeats

pytestmark = pytest.mark.slow

EXTRA = """
[distributed]
max_restarts = 1
[checkpoint]
every_steps = 3
keep_last = 2
async_write = {async_write}
"""


def check_latest(run: Path) -> str:
    """LATEST names a complete checkpoint that loads with weights_only (or there is none)."""
    ckpts = run / "checkpoints"
    latest = ckpts / "LATEST"
    if not latest.exists():
        assert not list(ckpts.glob("step-*")), "complete checkpoints but no LATEST"
        return "none yet"
    name = latest.read_text().strip()
    path = ckpts / name
    assert (path / "meta.json").is_file(), f"LATEST names {name}, which is incomplete"
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    assert state["step"] > 0 and state["model"] and len(state["ranks"]) == 2
    return name


def run_processes(run: Path, console) -> set[int]:
    """Every pid this run has had: console, supervisor, torchrun, ranks (any restart)."""
    status = read_status(run)
    pids = {console.pid}
    for key in ("supervisor", "torchrun"):
        if status.get("pids", {}).get(key):
            pids.add(status["pids"][key])
    pids.update(status.get("pids", {}).get("workers") or [])
    pids.update(b["pid"] for b in read_heartbeats(run))
    return pids


def descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def stepping_or_ended(run: Path) -> str | None:
    """``stepping`` once the current worker group made a step, ``ended`` if the run is over."""
    status = read_status(run)
    supervisor = status.get("pids", {}).get("supervisor")
    if status.get("ended") or (supervisor and not pid_alive(supervisor)):
        return "ended"
    starts = events_of(run, "start")
    if starts and any(e["t"] >= starts[-1]["t"] for e in events_of(run, "step")):
        return "stepping"
    return None


def kill_at_a_random_moment(rng: random.Random, run: Path, console) -> str:
    """One SIGKILL: returns what was killed."""
    status = read_status(run)
    beats = {b["rank"]: b for b in read_heartbeats(run) if b["phase"] not in ("done", "failed")}
    targets = ["rank", "rank", "writer", "torchrun", "supervisor", "console"]
    what = rng.choice(targets)
    if what == "writer":  # rank 0 in the middle of writing a checkpoint
        ckpts = run / "checkpoints"
        end = time.monotonic() + 10
        writer = beats.get(0, {}).get("pid")
        while time.monotonic() < end and not any(
            p.name.startswith(".tmp-") and p.name.endswith(f"-{writer}") for p in ckpts.iterdir()
        ):
            time.sleep(0.002)  # a write lasts tens of milliseconds: poll tightly
        pid = beats.get(0, {}).get("pid")  # caught mid-write, or wherever rank 0 is
    elif what == "rank":
        time.sleep(rng.uniform(0, 1.5))
        pid = beats.get(rng.choice([0, 1]), {}).get("pid")
    elif what == "console":
        pid = console.pid
    else:
        time.sleep(rng.uniform(0, 1.5))
        pid = status.get("pids", {}).get(what)
    if not pid or not pid_alive(pid):
        return ""
    writer = beats.get(0, {}).get("pid")  # a .tmp- directory of the live rank 0: mid-write
    mid_write = any(
        p.name.startswith(".tmp-") and p.name.endswith(f"-{writer}")
        for p in (run / "checkpoints").iterdir()
    )
    os.kill(pid, signal.SIGKILL)
    return f"{what} (mid-write)" if mid_write else what


def test_soak_random_kill_9_never_loses_a_checkpoint(procs, runs_dir, tmp_path):
    target = int(os.environ.get("GPU_CONSOLE_SOAK_KILLS", "40"))
    seed = int(os.environ.get("GPU_CONSOLE_SOAK_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"\nsoak: seed {seed}, {target} kills")
    kills: dict[str, int] = {}
    rounds = 0
    while sum(kills.values()) < target:
        rounds += 1
        folder = runs_dir / f"round-{rounds:03d}"
        extra = EXTRA.format(async_write="true" if rounds % 2 else "false")
        profile = fast_profile(tmp_path, max_steps=1_000_000, extra=extra, ranks=2)
        text = profile.read_text().replace("hidden_dim = 64", "hidden_dim = 768\nnum_layers = 4")
        profile.write_text(text)  # ~1.2 M parameters: a checkpoint write takes a moment
        console = procs.start("run", str(profile), "--headless", "--runs-dir", str(folder))
        run = wait_for(lambda f=folder: run_dirs(f) and only_run(f), what="the run directory")
        ever: set[int] = set()
        while True:
            if wait_for(lambda r=run: stepping_or_ended(r), 180, "a step") == "ended":
                break
            ever |= run_processes(run, console)
            ever |= descendants(read_status(run)["pids"]["supervisor"])
            starts = len(events_of(run, "start"))
            what = kill_at_a_random_moment(rng, run, console)
            if what:
                kills[what] = kills.get(what, 0) + 1
            check_latest(run)
            status = read_status(run)
            sup_alive = pid_alive(status["pids"]["supervisor"])
            if what.startswith(("supervisor", "torchrun")) or not sup_alive:
                break
            if what.startswith(("rank", "writer")):
                # Restarted (a restart left) or failed (none left): wait for either.
                outcome = wait_for(
                    lambda r=run, n=starts: (
                        "ended"
                        if read_status(r).get("ended")
                        else "restarted"
                        if len(events_of(r, "start")) > n
                        else None
                    ),
                    timeout=180,
                    what="a restart or the end",
                )
                check_latest(run)
                if outcome == "ended":
                    assert read_status(run)["state"] == "failed"
                    break
            if sum(kills.values()) >= target:
                procs.cli("stop", "--now", str(run), "--runs-dir", str(folder))
                break
        # The run is over (failed, lost, or stopped): nothing of it may stay alive.
        ever |= run_processes(run, console)
        wait_for(
            lambda e=frozenset(ever - {console.pid}): not any(pid_alive(p) for p in e),
            timeout=60,
            what="every process of the run to be gone",
        )
        name = check_latest(run)
        print(
            f"round {rounds} (async_write {extra.split()[-1]}): "
            f"{read_status(run).get('state')}, restarts "
            f"{read_status(run).get('restarts') or 0}, LATEST {name}, kills so far {kills}"
        )
        if pid_alive(console.pid):
            console.kill()
        console.communicate(timeout=deadline(60))
    total = sum(kills.values())
    print(f"soak: {total} kills in {rounds} runs ({kills}), seed {seed}: nothing lost")
    assert total >= target
