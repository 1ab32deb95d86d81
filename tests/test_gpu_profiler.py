"""The profiler and the OOM memory snapshot on a real GPU: ``python -m pytest -m gpu``.

Skipped, with the reason, where torch cannot use CUDA (see test_gpu.py)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import events_of, only_run, read_status
from test_gpu import CUDA, WHY, first_step, headless

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {WHY}")]

# test_gpu.py's OOM: ~100M parameters, 8192 sequences of 512 tokens a step.
OOM = {
    "task.d_model": 1024,
    "task.n_heads": 8,
    "task.n_layers": 8,
    "task.seq_len": 512,
    "task.train_samples": 8192,
    "task.eval_samples": 0,
    "data.batch_size": 8192,
}


def test_an_oom_writes_the_memory_snapshot_and_names_it(procs, runs_dir):
    args = [x for k, v in OOM.items() for x in ("--set", f"{k}={v}")]
    args += ["--set", "hardware.memory_snapshot_on_oom=true"]
    result = headless(procs, runs_dir, "transformer", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    run = only_run(runs_dir)
    (start,) = events_of(run, "start")
    assert start["memory_snapshot_on_oom"] == "on"
    snapshot = run / "oom-memory-rank0.pickle"
    assert snapshot.is_file()
    with snapshot.open("rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"]  # the allocator's state and its history
    summary = read_status(run)["failure"]["summary"]
    assert f"CUDA memory snapshot: {snapshot}" in summary, summary
    assert str(snapshot) in result.stdout + result.stderr


def test_profile_traces_cuda_kernels(procs, runs_dir, tmp_path):
    _, run = first_step(procs, runs_dir, tmp_path)
    res = procs.cli("profile", run.name, "--steps", "2", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    trace = Path(res.stdout.split(" (")[0]) / "rank0.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the CUDA activity
    assert any(e.get("name") == "aten::addmm" for e in events)
