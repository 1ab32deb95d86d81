"""ExitWatch: a poll's sleep that ends when the watched child exits (the run's end is seen at
once by the supervisor and the headless console)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpu_console.exit_watch import ExitWatch

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_the_sleep_ends_when_the_child_exits_not_when_the_interval_does():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        watch = ExitWatch(child.pid)
        started = time.monotonic()
        watch.sleep(600)  # an interval no test would wait out
        # Generous: the child's own life is 0.3 s; only a wake on its exit gets here this soon.
        assert time.monotonic() - started < 120
        assert child.wait(timeout=60) == 0
        watch.sleep(600)  # the exit stays seen: every later poll returns at once
        watch.close()
    finally:
        child.kill()
        child.wait()


def test_without_a_process_to_watch_it_sleeps_the_interval():
    watch = ExitWatch(None)
    started = time.monotonic()
    watch.sleep(0.05)
    assert time.monotonic() - started >= 0.05
