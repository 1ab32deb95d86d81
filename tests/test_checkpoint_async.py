"""Asynchronous checkpoints (checkpoint.async_write): what is written, on the engine harness
(tests/harness.py); a stop or a kill -9 during a write, through real torchrun.

Training waits only for a copy of the state; a thread writes it. The write is slowed
through the writer's test-only seam (``GPU_CONSOLE_TEST_CHECKPOINT_DELAY_S``: it sleeps
before serialising and again before the rename), so the tests can act while it is in flight.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    deadline,
    events_of,
    fast_profile,
    paced_profile,
    read_events,
    read_status,
    the_run,
    wait_for,
)
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console.engine.checkpoint import DELAY_ENV
from gpu_console.events import append_control
from gpu_console.state import read_heartbeats

DELAY_S = 0.5  # each of the two sleeps: a write lasts at least 2 × DELAY_S
# The same in the pytest process, where a rank on the harness computes with pytest's threads
# (not torchrun's one): on a busy machine its three steps can take longer than a 1 s write.
HARNESS_DELAY_S = 1.5


def _same(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _state(run: Path, step: int) -> dict:
    path = run / "checkpoints" / f"step-{step:08d}" / "state.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def test_async_writes_what_sync_writes_and_training_goes_on_during_the_write(tmp_path):
    runs = {}
    for mode, env in (("true", {DELAY_ENV: str(HARNESS_DELAY_S)}), ("false", {})):
        extra = f"[checkpoint]\nevery_steps = 4\nkeep_last = 0\nasync_write = {mode}\n"
        profile = fast_profile(tmp_path, name=f"async-{mode}", max_steps=8, extra=extra)
        runs[mode] = run_engine(tmp_path, profile, runs_dir=tmp_path / "runs" / mode, env=env)
    for step in (4, 8):  # the copy was taken at its step, whatever training did meanwhile
        _same(_state(runs["true"], step), _state(runs["false"], step))

    events = [e for e in read_events(runs["true"]) if e["kind"] in ("step", "checkpoint")]
    first, end = (e for e in events if e["kind"] == "checkpoint")
    assert (first["step"], end["step"]) == (4, 8)
    # Training went on while step 4's checkpoint was written: steps 5-7 came before its event,
    # which the last step waited for before its own (events in step order).
    order = [(e["kind"], e["step"]) for e in events]
    assert order.index(("step", 7)) < order.index(("checkpoint", 4)) < order.index(("step", 8))
    assert first["write_s"] >= 2 * HARNESS_DELAY_S > first["blocked_s"]
    assert first["seconds"] >= first["write_s"] and first["bytes"] > 0
    # The end's checkpoint waited for step 4's write before taking its copy: one at a time.
    assert end["waited_s"] > 0 and end["blocked_s"] >= end["waited_s"]
    for e in events_of(runs["false"], "checkpoint"):  # synchronous: blocked for all of it
        assert e["blocked_s"] == e["seconds"] >= e["write_s"] and e["waited_s"] == 0


def _writing(run: Path) -> str | None:
    """The name of the checkpoint a write in flight is writing (its temporary directory)."""
    ckpts = run / "checkpoints"
    if not ckpts.is_dir():
        return None
    tmp = [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-step-")]
    return tmp[0].removeprefix(".tmp-").rsplit("-", 1)[0] if tmp else None


def test_a_stop_during_a_write_keeps_both_checkpoints_and_exits_0(procs, runs_dir, tmp_path):
    extra = "[checkpoint]\nevery_steps = 3\nkeep_last = 0\n"  # async_write: the default
    profile = paced_profile(tmp_path, max_steps=1_000_000, extra=extra)
    env = cli_env(PACE_S="0.02", **{DELAY_ENV: str(DELAY_S)})
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                          env=env, cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    in_flight = wait_for(lambda: _writing(run), what="a checkpoint write in flight")
    append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    final = read_status(run)
    assert final["state"] == "stopped" and final["checkpointed_on_stop"] is True
    saved = events_of(run, "checkpoint")
    *intervals, stop = saved
    assert {e["reason"] for e in intervals} == {"interval"} and stop["reason"] == "stop"
    # The interval writes follow one another (each lasts longer than three steps), so the
    # stop came with one in flight and waited for it before taking its own copy.
    assert in_flight in {Path(e["path"]).name for e in intervals}
    assert stop["waited_s"] > 0
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    assert latest == Path(stop["path"]).name
    for e in saved:
        assert (Path(e["path"]) / "meta.json").is_file()
        assert _state(run, e["step"])["step"] == e["step"]
    assert not _writing(run)


def test_kill_9_of_rank_0_mid_write_leaves_latest_complete_and_the_run_resumes(
    procs, runs_dir, tmp_path
):
    extra = "[distributed]\nmax_restarts = 1\n[checkpoint]\nevery_steps = 3\nkeep_last = 0\n"
    profile = paced_profile(tmp_path, max_steps=8, extra=extra)
    env = cli_env(PACE_S="0.02", **{DELAY_ENV: str(DELAY_S)})
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                          env=env, cwd=tmp_path)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: _writing(run) == "step-00000006", what="step 6's write in flight")
    (rank_0,) = [b["pid"] for b in read_heartbeats(run) if b["rank"] == 0]
    assert any(p.name.endswith(f"-{rank_0}") for p in (run / "checkpoints").iterdir())
    os.kill(rank_0, signal.SIGKILL)
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip() == "step-00000003"
    assert not (ckpts / "step-00000006").exists()
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    first, again = events_of(run, "start")
    assert again["start_step"] == 3
    assert again["resumed_from"].endswith("step-00000003")
    assert read_status(run)["state"] == "finished"
    assert [e["step"] for e in events_of(run, "checkpoint")] == [3, 6, 8]
    assert (ckpts / "LATEST").read_text().strip() == "step-00000008"
    assert _state(run, 6)["step"] == 6 and not _writing(run)


def test_the_copy_is_independent_of_training_and_keeps_tied_weights_shared():
    from gpu_console.engine.checkpoint_writer import Writer

    shared = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"a.weight": shared, "b.weight": shared}, "opt": [{"lr": [0.1]}]}
    writer = Writer(Path("."), torch.device("cpu"), True, None, 0, True)
    snap = writer._snapshot(state)
    shared.add_(1)  # training updates parameters in place
    state["opt"][0]["lr"][0] = 0.2
    assert torch.equal(snap["model"]["a.weight"], torch.arange(6.0).reshape(2, 3))
    assert snap["model"]["a.weight"] is snap["model"]["b.weight"]
    assert snap["opt"] == [{"lr": [0.1]}]
    again = writer._snapshot(state)  # the next checkpoint refills the same host buffers
    assert again["model"]["a.weight"].data_ptr() == snap["model"]["a.weight"].data_ptr()
    assert torch.equal(again["model"]["a.weight"], shared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_copy_lands_in_pinned_host_buffers():
    from gpu_console.engine.checkpoint_writer import Writer

    device = torch.device("cuda", 0)
    weight = torch.randn(1024, 1024, device=device)
    state = {"model": {"w": weight}, "step": torch.tensor(3)}  # a CPU tensor beside it
    snap = Writer(Path("."), device, True, None, 0, True)._snapshot(state)
    expected = weight.cpu()
    weight.add_(1)  # queued after the copy: the copy has the values before it
    torch.cuda.synchronize(device)
    copy = snap["model"]["w"]
    assert copy.device.type == "cpu" and copy.is_pinned()
    assert torch.equal(copy, expected) and int(snap["step"]) == 3
