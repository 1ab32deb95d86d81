"""``train.deterministic = true`` on a GPU, as docs/reproducibility.md promises it:
``python -m pytest -m gpu``.

Two runs of the same profile on GPU 0 give the same losses bit for bit, and a run stopped
at a checkpoint and resumed continues bit for bit as the uninterrupted run. The profile is
the built-in transformer (scaled_dot_product_attention, dropout, bf16 where the GPU has it):
the kind of run that, without deterministic mode, drifts in the last digits.
"""

from __future__ import annotations

import math

import pytest
from conftest import events_of, only_run
from test_gpu import CUDA, WHY, auto_precision, headless

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {WHY}")]

# A constant schedule: the resumed run's longer max_steps must not change its lr.
DETERMINISTIC = [
    "--set", "train.deterministic=true",
    "--set", "train.log_every=1",
    "--set", "train.schedule=\"constant\"",
    "--set", "train.warmup_steps=0",
    "--set", "train.eval_every=0",
    "--set", "checkpoint.every_steps=0",
    "--precision", "auto",
]  # fmt: skip


def losses(run) -> list[float]:
    values = [e["loss"] for e in events_of(run, "step")]
    assert values and all(math.isfinite(v) for v in values), values
    return values


def deterministic_run(procs, runs_dir, steps: int):
    result = headless(
        procs, runs_dir, "transformer", *DETERMINISTIC, "--set", f"train.max_steps={steps}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    start = events_of(run, "start")[0]
    assert start["device_type"] == "cuda" and start["precision"] == auto_precision(), start
    assert start["deterministic"] == {
        "enabled": True,
        "algorithms": True,
        "cublas_workspace_config": ":4096:8",
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32_matmul": False,
        "tf32_cudnn": False,
    }, start["deterministic"]
    return run


def test_two_deterministic_runs_on_gpu_0_give_identical_losses(procs, runs_dir):
    a = deterministic_run(procs, runs_dir / "a", 40)
    b = deterministic_run(procs, runs_dir / "b", 40)
    assert len(losses(a)) == 40
    assert losses(a) == losses(b)  # bit for bit, not approximately


def test_a_deterministic_resume_on_gpu_0_continues_bit_exactly(procs, runs_dir):
    reference = losses(deterministic_run(procs, runs_dir / "ref", 40))
    run = deterministic_run(procs, runs_dir / "split", 20)  # its end checkpoint: step 20
    resumed = procs.cli(
        "run", "--resume", str(run), "--headless", "--set", "train.max_steps=40",
        "--runs-dir", str(runs_dir / "split"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = events_of(run, "start")[1]
    assert second["start_step"] == 20 and second["deterministic"]["enabled"] is True
    assert losses(run) == reference
