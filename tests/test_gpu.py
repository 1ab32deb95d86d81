"""The GPU path for real, through the CLI as a user runs it: ``python -m pytest -m gpu``.

Every test here is marked ``gpu`` and skipped, with the reason, where torch cannot use CUDA.
Runs go to ``--devices 0`` (cuda:0, NVML's GPU 0: launch sets CUDA_DEVICE_ORDER=PCI_BUS_ID),
headless, each a few seconds of training. This process never makes a CUDA context of its
own (``torch.cuda.is_available()`` does not): GPU memory readings are the runs' alone. It
reads the GPU through NVML (gpu_console.telemetry.nvml, the real driver: conftest does not
pin a ``gpu`` test).
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
from conftest import (
    DEADLINE_S,
    events_of,
    fast_profile,
    only_run,
    paced_profile,
    pid_alive,
    read_status,
    run_dirs,
    the_run,
    wait_for,
)
from conftest import test_env as cli_env

from gpu_console.profile import BUILTIN_DIR

try:
    import torch

    CUDA = torch.cuda.is_available()
    WHY = "torch.cuda.is_available() is False"
except ImportError:  # pragma: no cover - torch is a dependency
    torch = None
    CUDA, WHY = False, "torch is not installed"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {WHY}")]

DEVICES = "0"
MIB = 2**20
# What a run may leave behind on the GPU after it ended: nothing of its own, but NVML's
# reading moves by a few MiB with other tenants and the driver's own bookkeeping.
FREED_SLACK = 256 * MIB
BUILTINS = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))
# A few steps of any built-in: short, with an eval and a checkpoint on the way.
FEW_STEPS = [
    "--set",
    "train.max_steps=30",
    "--set",
    "train.warmup_steps=5",
    "--set",
    "train.eval_every=15",
    "--set",
    "train.log_every=5",
    "--set",
    "checkpoint.every_steps=15",
]


def nvml_gpu0() -> dict:
    from gpu_console.telemetry import nvml

    return nvml.sample_gpu(int(DEVICES)).to_json()


def auto_precision() -> str:
    """What ``precision = "auto"`` must pick on GPU 0: bf16 from capability 8.0 (Ampere)."""
    cap = nvml_gpu0()["compute_capability"]
    assert cap, "NVML gave no compute capability for GPU 0"
    return "bf16" if tuple(cap) >= (8, 0) else "fp16"


def run_pids(run) -> set[int]:
    pids = read_status(run).get("pids") or {}
    found = {pids.get("supervisor"), pids.get("torchrun"), *(pids.get("workers") or [])}
    return {p for p in found if p}


def headless(procs, runs_dir, *args: str, env=None, cwd=None):
    return procs.cli(
        "run", *args, "--headless", "--devices", DEVICES, "--runs-dir", str(runs_dir),
        env=env, cwd=cwd,
    )  # fmt: skip


def first_step(procs, runs_dir, tmp_path, max_steps: int = 100_000, pace_s: float = 0.05):
    """A paced run on GPU 0 that is training (its first steps are in): (console, run)."""
    profile = paced_profile(tmp_path, max_steps=max_steps)
    console = procs.start(
        "run", str(profile), "--headless", "--devices", DEVICES, "--precision", "auto",
        "--runs-dir", str(runs_dir), cwd=tmp_path, env=cli_env(PACE_S=str(pace_s)),
    )  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), DEADLINE_S, "the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 3, DEADLINE_S, "steps on GPU 0")
    return console, run


def finite_losses(run) -> list[float]:
    losses = [e["loss"] for e in events_of(run, "step")]
    assert losses and all(math.isfinite(x) for x in losses), losses
    return losses


# -- every built-in profile, auto precision, NCCL -------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_profile_trains_on_gpu_0(procs, runs_dir, name):
    result = headless(procs, runs_dir, name, *FEW_STEPS)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    start = events_of(run, "start")[0]
    assert start["device_type"] == "cuda" and start["world_size"] == 1, start
    assert start["backend"] == "nccl", start
    assert start["precision"] == auto_precision(), start  # the profile says "auto"
    steps = events_of(run, "step")
    assert steps[-1]["step"] == 30
    finite_losses(run)
    assert all(m["peak"] > 0 for m in steps[-1]["memory"])  # CUDA's allocator, not psutil
    assert events_of(run, "eval"), "no eval ran"
    status = read_status(run)
    assert status["state"] == "finished" and status["exit_code"] == 0


def test_fp16_trains_with_a_grad_scaler(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=40)
    result = headless(procs, runs_dir, str(profile), "--precision", "fp16")
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    start = events_of(run, "start")[0]
    assert (start["device_type"], start["precision"]) == ("cuda", "fp16"), start
    losses = finite_losses(run)
    assert losses[-1] < losses[0], losses
    # The scaler's state rides in every checkpoint; a run without one saves None there.
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    path = run / "checkpoints" / latest / "state.pt"
    # On the CPU: a CUDA context here would hold GPU memory the other tests measure.
    state = torch.load(path, map_location="cpu", weights_only=False)
    scaler = state["scaler"]
    assert scaler and scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0, scaler


# -- checkpoint → stop → resume ---------------------------------------------------------------


def test_checkpoint_stop_and_resume_continue_from_the_stop_step(procs, runs_dir, tmp_path):
    console, run = first_step(procs, runs_dir, tmp_path, max_steps=400)
    assert procs.cli("checkpoint", str(run), "--runs-dir", str(runs_dir)).returncode == 0
    wait_for(
        lambda: [c for c in events_of(run, "checkpoint") if c["reason"] == "request"],
        DEADLINE_S,
        "the requested checkpoint",
    )
    assert procs.cli("stop", str(run), "--runs-dir", str(runs_dir)).returncode == 0
    assert console.wait(DEADLINE_S) == 0
    assert read_status(run)["state"] == "stopped"
    stop = [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"]
    assert stop, events_of(run, "checkpoint")
    stopped_at = stop[-1]["step"]
    starts_before = {d: len(events_of(d, "start")) for d in run_dirs(runs_dir)}

    # Unpaced now: the rest of the 400 steps take a moment on a GPU.
    resumed = procs.cli(
        "run", "--resume", str(run), "--headless", "--runs-dir", str(runs_dir),
        cwd=tmp_path, env=cli_env(PACE_S="0"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # The continued run: a new start event, in this run's directory or in one of its own.
    starts = [
        (d, e)
        for d in run_dirs(runs_dir)
        for e in events_of(d, "start")[starts_before.get(d, 0) :]
        if e.get("resumed_from")
    ]
    assert len(starts) == 1, starts
    where, start = starts[0]
    assert start["device_type"] == "cuda" and start["start_step"] == stopped_at, start
    after = [e["step"] for e in events_of(where, "step") if e["t"] >= start["t"]]
    assert after[0] == stopped_at + 1 and after[-1] == 400, after[:3]
    assert read_status(where)["state"] == "finished"


# -- out of memory ----------------------------------------------------------------------------


def test_out_of_memory_names_the_gpu_and_says_what_to_change(procs, runs_dir):
    # ~100M parameters, 512 tokens a sequence, 8192 sequences a step: terabytes of activations.
    sets = {
        "task.d_model": 1024,
        "task.n_heads": 8,
        "task.n_layers": 8,
        "task.seq_len": 512,
        "task.train_samples": 8192,
        "task.eval_samples": 0,
        "data.batch_size": 8192,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    result = headless(procs, runs_dir, "transformer", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    run = only_run(runs_dir)
    summary = read_status(run)["failure"]["summary"]
    assert "ran out of memory on cuda:0" in summary, summary
    assert "lower data.batch_size (now 8192)" in summary, summary
    assert "ran out of memory on cuda:0" in result.stdout + result.stderr
    assert not any(pid_alive(p) for p in run_pids(run)), "a process of the run outlived it"


# -- what the GPU shows while a run holds it --------------------------------------------------


def test_nvml_samples_are_recorded_for_a_headless_run(procs, runs_dir, tmp_path):
    profile = paced_profile(tmp_path, max_steps=150)
    result = procs.cli(
        "run", str(profile), "--headless", "--devices", DEVICES, "--runs-dir", str(runs_dir),
        cwd=tmp_path, env=cli_env(PACE_S="0.03"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    status = read_status(run)
    path = run / "telemetry.jsonl"
    assert path.is_file(), "the supervisor wrote no telemetry.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    samples = [s for s in lines if s.get("kind") == "sample" and s.get("gpus")]
    during = [s for s in samples if status["started"] <= s["t"] <= status["ended"]]
    assert len(during) >= 2, f"{len(samples)} samples with GPUs, {len(during)} during the run"
    gpu0 = [g for s in during for g in s["gpus"] if g["index"] == int(DEVICES)]
    assert gpu0 and max(g["memory_used"] or 0 for g in gpu0) > 0, gpu0[-1:]


def test_devices_marks_the_gpu_of_a_running_run_busy(procs, runs_dir, tmp_path):
    before = nvml_gpu0()["memory_used"]
    console, run = first_step(procs, runs_dir, tmp_path)

    def busy() -> dict | None:
        doc = json.loads(procs.cli("devices", "--json").stdout)
        gpu = next(g for g in doc["gpus"] if g["index"] == int(DEVICES))
        grown = gpu["memory_used"] - before >= 100 * MIB  # the run's CUDA context and model
        return gpu if gpu["busy"] and grown else None

    gpu = wait_for(busy, 60, "devices --json to mark GPU 0 busy")
    assert gpu["busy_reasons"], gpu
    listed = {p["pid"] for p in gpu["processes"] or []}
    workers = set(read_status(run).get("pids", {}).get("workers") or [])
    # NVML lists host pids: in a container of its own pid namespace they are not ours.
    if listed and _same_pid_namespace():
        assert workers & listed, (workers, listed)
    assert procs.cli("stop", str(run), "--now", "--runs-dir", str(runs_dir)).returncode == 0
    console.wait(DEADLINE_S)


def _same_pid_namespace() -> bool:
    try:
        return os.readlink("/proc/self/ns/pid") == os.readlink("/proc/1/ns/pid")
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["rank", "torchrun"])
def test_kill_9_frees_the_gpu_and_leaves_no_process(procs, runs_dir, tmp_path, victim):
    before = nvml_gpu0()["memory_used"]
    console, run = first_step(procs, runs_dir, tmp_path)
    workers = wait_for(lambda: read_status(run).get("pids", {}).get("workers"), 60, "the rank pids")
    pids = run_pids(run)
    (held,) = wait_for(
        lambda: (m := nvml_gpu0()["memory_used"]) - before >= 100 * MIB and (m,),
        60,
        "the run's memory on GPU 0",
    )

    os.kill(
        workers[0] if victim == "rank" else read_status(run)["pids"]["torchrun"], signal.SIGKILL
    )
    wait_for(lambda: read_status(run).get("ended"), DEADLINE_S, "the run to end")
    assert console.wait(DEADLINE_S) == 1
    wait_for(lambda: not [p for p in pids if pid_alive(p)], 60, "every process of the run gone")
    status = read_status(run)
    assert status["state"] == "failed" and status["exit_code"] != 0, status
    wait_for(
        lambda: nvml_gpu0()["memory_used"] <= before + FREED_SLACK,
        60,
        f"GPU 0's memory back to {before / MIB:.0f} MiB (the run held {held / MIB:.0f} MiB)",
    )
    listed = {p["pid"] for p in nvml_gpu0()["processes"] or []}
    assert not listed & pids, f"NVML still lists {listed & pids} on GPU 0"
