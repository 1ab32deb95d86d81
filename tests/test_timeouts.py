"""Timeouts that fit the phase (issue 24): start-up's (``distributed.startup_timeout_s``)
until every rank's first step, then the collectives' (``distributed.collective_timeout_s``).
Real runs of 2 CPU ranks: a rank slower to build than the collective timeout still trains;
a rank that hangs after the first step fails the run within the collective timeout."""

from __future__ import annotations

import time

import conftest
import pytest
from conftest import events_of, only_run, read_status

COLLECTIVE_S = 3.0

# Rank 1 builds its model for twice the collective timeout: rank 0 waits in the build's
# collectives all that time (in the rank only: the launch's checks build outside torchrun).
SLOW_BUILD = f"""
import os
import time
from gpu_console.tasks.mlp import MLPTask


class SlowBuild(MLPTask):
    def build_model(self):
        if os.environ.get("RANK") == "1":
            time.sleep({2 * COLLECTIVE_S})
        return super().build_model()
"""

# Rank 1 hangs in its third training step, far longer than the collective timeout.
HANG_AT_3 = """
import os
import time
from gpu_console.tasks.mlp import MLPTask


class HangAt3(MLPTask):
    calls = 0

    def compute(self, model, batch):
        if model.training:
            HangAt3.calls += 1
            if os.environ.get("RANK") == "1" and HangAt3.calls == 3:
                time.sleep(120)
        return super().compute(model, batch)
"""


def _run(procs, runs_dir, tmp_path, module, source, cls, distributed):
    profile = conftest.task_profile(
        tmp_path,
        module,
        source,
        cls,
        max_steps=6,
        extra=f"\n[distributed]\n{distributed}\n",
        ranks=2,
    )
    began = time.monotonic()
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                       cwd=tmp_path)  # fmt: skip
    return result, only_run(runs_dir), time.monotonic() - began


def test_a_start_up_longer_than_the_collective_timeout_still_trains(procs, runs_dir, tmp_path):
    result, run, _ = _run(procs, runs_dir, tmp_path, "slow_build", SLOW_BUILD, "SlowBuild",
                          f"collective_timeout_s = {COLLECTIVE_S}")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (start,) = events_of(run, "start")
    assert start["timeouts"] == {"startup_s": 1800.0, "collective_s": COLLECTIVE_S}
    assert events_of(run, "step")[-1]["step"] == 6
    warnings = [e["message"] for e in events_of(run, "log") if e.get("level") == "warning"]
    assert not [w for w in warnings if "timeout" in w], warnings


def test_the_same_start_up_fails_under_a_start_up_timeout_as_short(procs, runs_dir, tmp_path):
    # The control: the slow build does meet a collective that times out.
    result, run, _ = _run(procs, runs_dir, tmp_path, "slow_build", SLOW_BUILD, "SlowBuild",
                          f"collective_timeout_s = {COLLECTIVE_S}\n"
                          f"startup_timeout_s = {COLLECTIVE_S}")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert read_status(run)["state"] == "failed"
    assert not events_of(run, "step")


@pytest.mark.parametrize("reduce", ["gloo", "shared-memory"])
def test_a_hang_after_the_first_step_fails_within_the_collective_timeout(
    procs, runs_dir, tmp_path, reduce
):
    distributed = f'collective_timeout_s = {COLLECTIVE_S}\ncpu_reduce = "{reduce}"'
    result, run, took = _run(procs, runs_dir, tmp_path, "hang_at_3", HANG_AT_3, "HangAt3",
                             distributed)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    status = read_status(run)
    assert status["state"] == "failed", status
    assert [e["step"] for e in events_of(run, "step")] == [1, 2]
    # rank 0 gave up on rank 1 after the collective timeout, not the start-up one (30 min),
    # and long before rank 1's hang (120 s) would have ended.
    reason = status.get("reason") or ""
    said = "Timed out" if reduce == "gloo" else "did not arrive within 3 s"
    assert said in reason or said in out, (reason, out)
    assert took < 90, took
    last_step_t = events_of(run, "step")[-1]["t"]
    failed_t = next(e["t"] for e in events_of(run, "status") if e.get("state") == "failed")
    assert COLLECTIVE_S - 1 < failed_t - last_step_t < COLLECTIVE_S + 20, failed_t - last_step_t
