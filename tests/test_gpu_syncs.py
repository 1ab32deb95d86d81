"""On a GPU: no host sync in a training step outside log steps, and MFU in the events.

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising CUDA call raise. The
task below turns it on at the start of each step that is neither a log step nor one of the
first two log intervals (warm-up: the first control checks, DDP's bucket rebuild) and off
at the others, so a sync anywhere in such a step (forward, backward, the gradient norm, the
nan_policy check, the update, the schedule) fails the rank, and the run with it.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import POISONED_TASK, events_of, only_run, read_status, task_profile
from conftest import test_env as cli_env

from gpu_console.engine.nonfinite import ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
]

LOG_EVERY = 5

SYNC_CHECKED_TASK = f"""
import torch
from gpu_console.tasks.mlp import MLPTask


class SyncChecked(MLPTask):
    steps = 0

    def compute(self, model, batch):
        if model.training:
            SyncChecked.steps += 1
            s = SyncChecked.steps
            quiet = s > 2 * {LOG_EVERY} and s % {LOG_EVERY} != 0
            torch.cuda.set_sync_debug_mode("error" if quiet else "default")
        return super().compute(model, batch)
"""


def _run(procs, tmp_path, policy: str, check: str = "auto"):
    where = tmp_path / f"{policy}-{check}"
    where.mkdir()
    profile = task_profile(
        where, "sync_checked", SYNC_CHECKED_TASK, "SyncChecked", max_steps=60, devices="0"
    )
    text = profile.read_text()
    profile.write_text(text.replace('precision = "fp32"', 'precision = "auto"'))
    result = procs.cli(
        "run",
        str(profile),
        "--headless",
        "--runs-dir",
        str(where / "runs"),
        "--set",
        f"train.nan_policy={policy}",
        "--set",
        f"train.log_every={LOG_EVERY}",
        "--set",
        "train.eval_every=0",
        "--set",
        "task.eval_samples=0",
        "--set",
        "checkpoint.every_steps=0",
        cwd=where,
        env=cli_env(**{ENV: check}),
        timeout=300,
    )
    return result, only_run(where / "runs")


@pytest.mark.parametrize("policy", ["stop", "skip", "ignore"])
def test_no_host_sync_between_log_steps(procs, tmp_path, policy):
    result, run = _run(procs, tmp_path, policy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_status(run)["state"] == "finished"
    assert max(e["step"] for e in events_of(run, "step")) == 60


def test_the_per_step_check_is_a_sync_the_test_sees(procs, tmp_path):
    # The check this engine replaced: reading the norm every step. The test must see it.
    result, run = _run(procs, tmp_path, "stop", check="each-step")
    assert result.returncode == 1
    assert "synchroniz" in read_status(run)["failure"]["summary"]


def test_a_gpu_run_reports_mfu_against_its_peak(procs, tmp_path):
    result, run = _run(procs, tmp_path, "stop")
    assert result.returncode == 0, result.stdout + result.stderr
    (start,) = events_of(run, "start")
    assert start["flops_from"] == "task" and start["flops_per_sample"] > 0
    steps = events_of(run, "step")
    if start["peak_flops"] is None:  # a GPU the table does not know says so
        assert start["mfu_not_shown"].startswith("unknown GPU")
        assert not any("mfu" in s for s in steps)
    else:
        assert start["mfu_not_shown"] is None and "dense" in start["peak"]
        assert all(0 < s["mfu"] < 1 for s in steps)
        assert re.search(r"^MFU: \d+\.\d% \(mean\)$", result.stdout, re.M)


# The only rank's loss is NaN on its 5th and 6th batches (log_every 3: read at step 6).
POISONED_GPU_TASK = POISONED_TASK.replace('os.environ["RANK"] == "1"', 'os.environ["RANK"] == "0"')


def _poisoned_gpu_run(procs, tmp_path, policy: str):
    profile = task_profile(
        tmp_path, "poisoned", POISONED_GPU_TASK, "Poisoned", max_steps=12, devices="0"
    )
    text = profile.read_text()
    profile.write_text(text.replace('precision = "fp32"', 'precision = "bf16"'))
    result = procs.cli(
        "run",
        str(profile),
        "--headless",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--set",
        f"train.nan_policy={policy}",
        "--set",
        "train.log_every=3",
        cwd=tmp_path,
        timeout=300,
    )
    return result, only_run(tmp_path / "runs")


def test_nan_stop_on_a_gpu_checkpoints_the_last_finite_state(procs, tmp_path):
    result, run = _poisoned_gpu_run(procs, tmp_path, "stop")
    assert result.returncode == 1, result.stdout + result.stderr
    summary = read_status(run)["failure"]["summary"]
    assert "loss is nan in step 5 (train.nan_policy = 'stop')" in summary
    assert "checkpoint step-00000004 holds the last finite state" in summary
    state = torch.load(run / "checkpoints" / "step-00000004" / "state.pt", weights_only=True)
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert max(e["step"] for e in events_of(run, "step")) == 3


def test_nan_skip_on_a_gpu_counts_the_skipped_updates(procs, tmp_path):
    result, run = _poisoned_gpu_run(procs, tmp_path, "skip")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = events_of(run, "step")
    assert [s["skipped"] for s in steps] == [0, 2, 0, 0]
    assert all(s["loss"] == s["loss"] for s in steps[2:])  # finite again after the skips
