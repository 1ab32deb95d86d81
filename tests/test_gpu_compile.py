"""train.compile and activation checkpointing on GPU 0, for real: ``python -m pytest -m gpu``.

Marked ``gpu`` and skipped without CUDA (as tests/test_gpu.py). The CPU suite covers the
same paths on 2 CPU ranks (test_compile.py, test_activation_checkpointing.py); here: the
compiled transformer trains in bf16 through the ``compiling`` state, and checkpointing the
blocks lowers the run's peak allocated memory on the device.
"""

from __future__ import annotations

import math

import pytest
from conftest import events_of, run_dirs

try:
    import torch

    CUDA = torch.cuda.is_available()
    WHY = "torch.cuda.is_available() is False"
except ImportError:  # pragma: no cover - torch is a dependency
    CUDA, WHY = False, "torch is not installed"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {WHY}")]

SHORT = [
    "--set", "train.max_steps=20", "--set", "train.log_every=5", "--set", "train.eval_every=10",
    "--set", "checkpoint.every_steps=0", "--set", "data.batch_size=128",
]  # fmt: skip


def _run(procs, runs_dir, name: str, *sets: str):
    args = ["run", "transformer", "--headless", "--devices", "0", "--runs-dir", str(runs_dir)]
    args += ["--name", name, *SHORT]
    for s in sets:
        args += ["--set", s]
    done = procs.cli(*args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = [r for r in run_dirs(runs_dir) if r.name.startswith(name + "-")]
    return run


def test_compiled_transformer_trains_on_gpu_0(procs, runs_dir):
    run = _run(procs, runs_dir, "compiled", "train.compile=true")
    assert events_of(run, "start")[0]["compile"] == "default"
    states = [e["state"] for e in events_of(run, "status")]
    assert states[:3] == ["starting", "compiling", "running"], states
    steps = events_of(run, "step")
    assert steps[-1]["step"] == 20 and all(math.isfinite(e["loss"]) for e in steps)
    assert steps[-1]["recompiles"] == 0


def test_checkpointed_blocks_lower_the_peak_allocated_memory(procs, runs_dir):
    peaks = {}
    for mode in ("none", "blocks"):
        run = _run(procs, runs_dir, mode, f"train.activation_checkpointing={mode!r}")
        peaks[mode] = max(m["peak"] for e in events_of(run, "step") for m in e["memory"])
        start = events_of(run, "start")[0]
        if mode == "blocks":
            held = start["activation_checkpointing"]
            assert 0 < held["held_with"] < held["held_without"], held
    assert peaks["blocks"] < peaks["none"], peaks
