"""Start-up stage times (gpu_console/timings.py): where the time from the command to the first
step went, in the start event and the first step event. Real CLI, supervisor and torchrun,
2 CPU ranks. No timed assertion: only that every stage is there, in order (benchmarks/startup.py
measures them)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import deadline, events_of, fast_profile, only_run

from gpu_console.runs import current_session
from gpu_console.timings import FIRST_STEP, STAGES, Stopwatch

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_the_start_event_carries_every_stage_in_order_and_the_first_step_event_the_first_step(
    procs, runs_dir, tmp_path
):
    profile = fast_profile(tmp_path, max_steps=6, extra="[checkpoint]\nat_end = false\n")
    before = time.time()
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    after = time.time()
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)

    timings = events_of(run, "start")[0]["timings"]
    launched = timings["launched"]
    # The command's own process start: before meta.json was written, after the test began it.
    session = current_session(json.loads((run / "meta.json").read_text()))
    assert session["launched"] == launched
    assert before - 1 < launched <= session["started"]
    stages = timings["stages"]
    assert list(stages) == list(STAGES)  # none missing, in the order they happen
    seconds = list(stages.values())
    assert seconds == sorted(seconds) and seconds[0] >= 0, stages
    assert launched + seconds[-1] <= after

    # log_every = 1: the first step event carries the first step; no later one carries any.
    steps = events_of(run, "step")
    assert steps[0]["timings"] == {FIRST_STEP: steps[0]["timings"][FIRST_STEP]}
    assert stages["ddp"] <= steps[0]["timings"][FIRST_STEP] <= steps[0]["t"] - launched + 0.002
    assert all("timings" not in e for e in steps[1:])


def test_a_stopwatch_without_a_launch_time_counts_from_the_session_start(monkeypatch):
    # A run launched before sessions recorded ``launched`` (meta.json from an older version).
    monkeypatch.setenv("GPU_CONSOLE_TIMINGS", json.dumps({"supervisor": 101.0, "torchrun": 101.5}))
    watch = Stopwatch()
    watch.session = {"started": 100.0}
    watch.marks = {"rank": 102.0, "imports": 103.25}
    found = watch.start_fields()["timings"]
    assert found == {
        "launched": 100.0,
        "stages": {
            "created": 0.0,
            "supervisor": 1.0,
            "torchrun": 1.5,
            "rank": 2.0,
            "imports": 3.25,
        },
    }
    assert watch.first_step_fields() == {}  # no step done yet
    watch.marks[FIRST_STEP] = 104.0
    assert watch.first_step_fields() == {"timings": {FIRST_STEP: 4.0}}
    assert watch.first_step_fields() == {}  # only the first step event carries it


def test_a_rank_waits_for_rank_0s_store_to_listen_then_goes_on_at_once():
    import socket
    import threading

    from gpu_console.engine.distributed import wait_for_store

    with socket.socket() as probe:  # a free port, then nothing listens on it for a while
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    accepted = threading.Event()

    def store_comes_up_later():
        time.sleep(0.3)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            server.settimeout(60)
            conn, _ = server.accept()
            conn.close()
            accepted.set()

    thread = threading.Thread(target=store_comes_up_later)
    thread.start()
    wait_for_store("127.0.0.1", str(port))  # refused at first: it keeps probing
    thread.join(timeout=60)
    assert accepted.is_set()
    wait_for_store(None, None)  # not under torchrun: nothing to wait for


AGE = (
    "import time; from gpu_console.timings import process_start_time; "
    "print(time.time() - process_start_time())"
)


def test_a_command_a_shell_execs_after_other_work_counts_from_its_own_start():
    """``pip install … && gpu-console run …`` in a script: the shell execs its last command in
    its own process, whose /proc start is the shell's, before pip. The launch's start is the
    interpreter's, not the shell's: a start-up of seconds, not minutes."""
    gap = 4  # the shell's earlier work: a wait that uses no CPU, as waiting for pip does
    chained = subprocess.run(
        ["sh", "-c", f'sleep {gap} && exec "$0" -c "$1"', sys.executable, AGE],
        capture_output=True, text=True, check=True, timeout=deadline(120),
    )  # fmt: skip
    assert float(chained.stdout) < gap - 0.5, chained.stdout
    # A command started as itself keeps /proc's start (its interpreter's start-up counted).
    plain = subprocess.run([sys.executable, "-c", AGE], capture_output=True, text=True, check=True)
    assert 0 < float(plain.stdout) < gap - 0.5
