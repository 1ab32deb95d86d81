"""The engine through the product's own path: gpu-console → supervisor → torchrun → 2 ranks.

The process tree's tests here (Ctrl-C and resume, kill -9 of the supervisor and the agent, a
launch's refusal) start real processes (2 CPU ranks on gloo) and wait on events; the engine's
(a run.toml that reproduces its run, gradient accumulation, the DDP knobs, an eval with fewer
samples than ranks) run on the engine harness (tests/harness.py), 2 forked ranks.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import conftest
import pytest
from conftest import (
    deadline,
    events_of,
    fast_profile,
    only_run,
    paced_profile,
    pid_alive,
    read_status,
    the_run,
    wait_for,
)
from harness import run_engine

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(run_dir, "step")}


@pytest.mark.torch_floor
def test_quickstart_learns_and_leaves_a_complete_run_directory(recorded_run):
    # The session's quickstart run (conftest), pinned to 2 CPU ranks: quickstart's devices are
    # "auto", a GPU wherever NVML sees one (tests/test_gpu.py runs it there).
    run = recorded_run
    assert only_run(run.parent) == run

    steps = events_of(run, "step")
    assert steps[-1]["step"] == 300
    first, last = steps[0]["loss"], steps[-1]["loss_avg"]
    assert last < 0.7 * first, f"loss did not fall: {first} → {last}"
    assert events_of(run, "eval")[-1]["accuracy"] > 0.5  # ten classes: chance is 0.1

    start = events_of(run, "start")[0]
    assert start["world_size"] == 2 and start["device_type"] == "cpu"
    assert start["precision"] == "fp32" and start["backend"] == "gloo"
    assert start["optimizer"] == "AdamW (fused)"  # train.optimizer_impl = "auto" on CPU
    assert start["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # each rank's share
    assert [s["rank"] for s in steps[-1]["memory"]] == [0, 1]
    assert all(m["peak"] > 0 for m in steps[-1]["memory"])
    assert [e["state"] for e in events_of(run, "status")] == ["starting", "running", "finished"]

    status = read_status(run)
    assert status["state"] == "finished" and status["exit_code"] == 0
    assert status["step"] == 300 and status["ended"] >= status["started"]

    # Files of DESIGN.md's run directory, with their modes.
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "control.jsonl").stat().st_mode) == 0o600
    for name in ("run.toml", "meta.json", "status.json", "events.jsonl"):
        assert (run / name).is_file(), name
    rank_logs = sorted(run.glob("logs/*/attempt_0/*/stdout.log"))
    assert len(rank_logs) == 2
    assert (run / "logs" / "torchrun.log").is_file()

    # Checkpoints: interval ones, pruned to keep_last = 2, LATEST names the newest complete.
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000200", "step-00000300"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000300"
    assert not list((run / "checkpoints").glob(".tmp-*"))

    # run.toml is the resolved profile: every section, every default filled in.
    resolved = tomllib.loads((run / "run.toml").read_text())
    assert set(resolved) == {
        "profile",
        "task",
        "data",
        "train",
        "distributed",
        "checkpoint",
        "hardware",
        "logging",
        "cluster",
    }
    assert resolved["train"]["max_steps"] == 300 and resolved["train"]["nan_policy"] == "stop"
    assert resolved["task"]["kind"] == "mlp" and "noise" in resolved["task"]


def test_run_toml_reproduces_the_run(tmp_path):
    profile = fast_profile(tmp_path, max_steps=conftest.FAST_RUN_STEPS, ranks=2)
    run_a = run_engine(tmp_path, profile, ranks=2, runs_dir=tmp_path / "a")
    assert len(losses(run_a)) == conftest.FAST_RUN_STEPS
    # The run's run.toml as the profile of another run (what `gpu-console run RUN/run.toml` is).
    run_b = run_engine(tmp_path, run_a / "run.toml", ranks=2, runs_dir=tmp_path / "b")
    assert events_of(run_b, "status")[-1]["state"] == "finished"
    assert only_run(tmp_path / "b") == run_b
    assert (run_a / "run.toml").read_text() == (run_b / "run.toml").read_text()
    # The harness gives both launches cpu:2, as the CLI takes it from the file alone: the
    # file names it.
    assert tomllib.loads((run_b / "run.toml").read_text())["hardware"]["devices"] == "cpu:2"
    assert losses(run_a) == losses(run_b)  # bitwise deterministic on CPU


@pytest.mark.torch_floor
def test_ctrl_c_stops_with_a_checkpoint_and_resume_is_bit_exact(procs, runs_dir, tmp_path):
    profile = paced_profile(tmp_path, max_steps=400, extra="[checkpoint]\nkeep_last = 0\n", ranks=2)
    dropout = ["--set", "task.dropout=0.1"]  # dropout draws from every rank's RNG stream

    # The uninterrupted run's losses from the engine harness: the ranks torchrun starts and
    # the harness's forked ones compute the same, bit for bit, or this test fails.
    expected = losses(
        run_engine(tmp_path, profile, "task.dropout=0.1", ranks=2, runs_dir=runs_dir / "ref")
    )
    assert len(expected) == 400

    # Paced at 20 ms a step, the 400 steps take 8 s or more: Ctrl-C lands long before the end.
    console = procs.start(
        "run",
        str(profile),
        "--headless",
        "--runs-dir",
        str(runs_dir / "stopped"),
        *dropout,
        cwd=tmp_path,
        env=conftest.test_env(PACE_S="0.02"),
    )
    run = wait_for(
        lambda: the_run(runs_dir / "stopped"),
        what="the run directory",
    )
    wait_for(lambda: len(events_of(run, "step")) >= 20, what="20 steps")
    console.send_signal(signal.SIGINT)
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    assert "stopping" in out

    status = read_status(run)
    assert status["state"] == "stopped" and status["exit_code"] == 0
    stop_ckpt = [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"]
    assert len(stop_ckpt) == 1
    stopped_at = stop_ckpt[0]["step"]
    assert 20 <= stopped_at < 400
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    assert latest == f"step-{stopped_at:08d}"
    for key in ("supervisor", "torchrun"):
        assert not pid_alive(status["pids"][key])

    # The resume continues in the run's own directory, whatever --runs-dir says.
    resumed = procs.cli(
        "run",
        "--resume",
        str(run),
        "--headless",
        "--runs-dir",
        str(runs_dir / "resumed"),
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert not (runs_dir / "resumed").exists() and only_run(runs_dir / "stopped") == run
    (_, second) = events_of(run, "start")
    assert second["start_step"] == stopped_at
    after = [e for e in events_of(run, "step") if e["t"] >= second["t"]]
    assert after[0]["step"] == stopped_at + 1 and after[-1]["step"] == 400
    # One run, one history: every step's loss, bit for bit the uninterrupted run's.
    assert losses(run) == expected, "resumed losses differ from the reference"


def test_four_micro_batches_of_8_match_one_batch_of_32(tmp_path):
    import torch

    # One batch of 32: the fast profile's own batch size and grad_accum (1).
    steps = conftest.FAST_RUN_STEPS
    profile = fast_profile(tmp_path, max_steps=steps, ranks=2)
    run_one = run_engine(tmp_path, profile, ranks=2, runs_dir=tmp_path / "one")
    one = tomllib.loads((run_one / "run.toml").read_text())
    assert (one["data"]["batch_size"], one["train"]["grad_accum"]) == (32, 1)
    run_four = run_engine(tmp_path, profile, "data.batch_size=8", "train.grad_accum=4", ranks=2,
                          runs_dir=tmp_path / "four")  # fmt: skip
    assert events_of(run_four, "status")[-1]["state"] == "finished"
    a, b = losses(run_one), losses(run_four)
    assert a.keys() == b.keys() and len(a) == steps
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6)
    assert events_of(run_one, "start")[0]["global_batch"] == 64
    assert events_of(run_four, "start")[0]["global_batch"] == 64

    def final_weights(run):
        end = run / "checkpoints" / f"step-{steps:08d}" / "state.pt"
        return torch.load(end, weights_only=True)["model"]

    wa, wb = final_weights(run_one), final_weights(run_four)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5)


def test_every_ddp_knob_reaches_the_ddp_constructor(tmp_path):
    profile = fast_profile(tmp_path, max_steps=3, ranks=2)
    knobs = {
        "static_graph": True,
        "bucket_cap_mb": 7.0,
        "find_unused_parameters": True,
        "broadcast_buffers": False,
        "gradient_as_bucket_view": False,
    }
    sets = [f"distributed.{key}={str(value).lower()}" for key, value in knobs.items()]
    run = run_engine(tmp_path, profile, *sets, "task.batch_norm=true", ranks=2,
                     runs_dir=tmp_path / "knobs")  # fmt: skip
    assert events_of(run, "status")[-1]["state"] == "finished"
    ddp = events_of(run, "start")[0]["ddp"]
    assert ddp == {**knobs, "sync_batchnorm": False}

    defaults = run_engine(tmp_path, profile, "task.batch_norm=true", ranks=2,
                          runs_dir=tmp_path / "d")  # fmt: skip
    assert events_of(defaults, "status")[-1]["state"] == "finished"
    ddp = events_of(defaults, "start")[0]["ddp"]
    assert ddp == {
        "static_graph": False,
        "bucket_cap_mb": 25.0,
        "find_unused_parameters": False,
        "broadcast_buffers": True,
        "gradient_as_bucket_view": True,
        "sync_batchnorm": False,
    }


@pytest.mark.parametrize(
    "setting, device, world, synced",
    [
        ("auto", "cuda", 2, True),  # the default: several CUDA ranks
        ("auto", "cuda", 1, False),  # one rank: nothing to sync
        ("auto", "cpu", 2, False),  # CPU ranks: plain BatchNorm (torch has no CPU SyncBN)
        (True, "cuda", 2, True),
        (True, "cuda", 1, True),  # as asked (the single-rank strategy has no DDP to convert)
        (False, "cuda", 2, False),
    ],
)
def test_sync_batchnorm_converts_batchnorm_layers(setting, device, world, synced):
    # PyTorch's SyncBatchNorm only runs on GPUs (CPU runs reject `true` at launch with exit
    # 2), so the conversion is checked at its seam: the module DDP would be given.
    from torch import nn

    from gpu_console.engine.distributed import convert_batchnorm
    from gpu_console.profile import DistributedConfig
    from gpu_console.tasks.configs import Autoencoder3DConfig, MLPConfig
    from gpu_console.tasks.mlp import MLPTask

    cfg = DistributedConfig(sync_batchnorm=setting)
    model = convert_batchnorm(MLPTask(MLPConfig(batch_norm=True)).build_model(), cfg, device, world)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == (2 if synced else 0)
    assert sum(isinstance(m, nn.BatchNorm1d) for m in model.modules()) == (0 if synced else 2)
    if synced:  # autoencoder3d's four BatchNorm3d too
        from gpu_console.tasks.autoencoder3d import Autoencoder3D

        volumes = convert_batchnorm(Autoencoder3D(Autoencoder3DConfig()), cfg, device, world)
        assert sum(isinstance(m, nn.SyncBatchNorm) for m in volumes.modules()) == 4


def test_sync_batchnorm_on_cpu_is_a_bad_input(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=3)
    result = procs.cli(
        "run",
        str(profile),
        "--headless",
        "--runs-dir",
        str(runs_dir),
        "--set",
        "distributed.sync_batchnorm=true",
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-console: --set: distributed.sync_batchnorm: SyncBatchNorm runs only on GPUs; "
        "this run is on CPU (got true)"
    ]
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def _long_run(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=1_000_000, ranks=2)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a first step")
    status = wait_for(
        lambda: (s := read_status(run)) and len(s["pids"].get("workers") or []) == 2 and s,
        what="two worker pids in status.json",
    )
    return console, run, status


def _all_gone(pids) -> bool:
    return not any(pid_alive(p) for p in pids)


def test_kill_9_of_the_supervisor_leaves_no_worker(procs, runs_dir, tmp_path):
    console, run, status = _long_run(procs, runs_dir, tmp_path)
    pids = status["pids"]
    procs_of_run = [pids["torchrun"], *pids["workers"]]
    import os

    os.kill(pids["supervisor"], signal.SIGKILL)
    wait_for(lambda: _all_gone(procs_of_run), timeout=30, what="torchrun and workers to die")
    # The console notices that the supervisor is gone and says so with exit code 1.
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 1, out + err
    assert "lost" in out


def test_kill_9_of_the_agent_leaves_no_worker_and_the_run_is_failed(procs, runs_dir, tmp_path):
    console, run, status = _long_run(procs, runs_dir, tmp_path)
    pids = status["pids"]
    import os

    os.kill(pids["torchrun"], signal.SIGKILL)
    wait_for(lambda: _all_gone(pids["workers"]), timeout=30, what="workers to die")
    out, err = console.communicate(timeout=deadline(60))
    assert console.returncode == 1, out + err
    final = read_status(run)
    assert final["state"] == "failed" and final["exit_code"] != 0
    assert not pid_alive(pids["supervisor"])


def test_eval_with_fewer_samples_than_ranks(tmp_path):
    # Rank 1 gets no eval batch at all; the ranks must still agree on one eval collective.
    profile = fast_profile(tmp_path, max_steps=4, ranks=2)
    run = run_engine(tmp_path, profile, "task.eval_samples=1", "train.eval_every=2", ranks=2)
    assert events_of(run, "status")[-1]["state"] == "finished"
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["accuracy"] in (0.0, 1.0) for e in evals)  # one sample: right or wrong
