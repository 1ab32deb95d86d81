"""nan_policy without a host sync per step: the deferred check must keep the semantics.

On GPUs the engine gates each update on the device (the fused AdamW's ``found_inf``) and
reads the verdicts at the next log or control step. ``GPU_CONSOLE_NONFINITE_CHECK=deferred``
takes that path on CPU too, so the poisoned runs below (the engine on 2 CPU ranks, in the
harness: tests/harness.py) go through it and are held against the per-step check they
replace.
"""

from __future__ import annotations

import pytest
import torch
from conftest import POISONED_TASK, events_of, task_profile
from harness import run_engine

from gpu_console.engine.nonfinite import ENV, Guard, deferrable, rewind_schedule
from gpu_console.engine.schedule import lr_factor
from gpu_console.profile import TrainConfig

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def _poisoned_run(tmp_path, name: str, policy: str, check: str):
    where = tmp_path / name
    where.mkdir()
    profile = task_profile(where, "poisoned", POISONED_TASK, "Poisoned", max_steps=12, ranks=2)
    return run_engine(
        where,
        profile,
        f"train.nan_policy={policy}",
        "train.log_every=3",  # steps 5 and 6 are bad; the deferred check reads them at 6
        ranks=2,
        env={ENV: check},
    )


def _checkpoint(run, step: int) -> dict:
    path = run / "checkpoints" / f"step-{step:08d}" / "state.pt"
    return torch.load(path, weights_only=True)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_deferred_stop_fails_at_the_same_step_with_the_same_checkpoint(tmp_path):
    now_run = _poisoned_run(tmp_path, "each", "stop", "each-step")
    later_run = _poisoned_run(tmp_path, "deferred", "stop", "deferred")
    for run in (now_run, later_run):
        # The engine failed the run (the supervisor takes its reason as the failure's summary).
        ended = events_of(run, "status")[-1]
        assert ended["state"] == "failed"
        assert "loss is nan in step 5 (train.nan_policy = 'stop')" in ended["reason"]
        assert "checkpoint step-00000004 holds the last finite state" in ended["reason"]
        assert max(e["step"] for e in events_of(run, "step")) == 3
        ckpt = events_of(run, "checkpoint")[-1]
        assert (ckpt["step"], ckpt["reason"]) == (4, "nan")
    # The deferred run computed step 6 too (its update gated on the device), then went back
    # to step 4: weights, moments, the optimizer's step count, the lr schedule and the data
    # position are those of the run that stopped before step 5's update.
    a, b = _checkpoint(now_run, 4), _checkpoint(later_run, 4)
    for key in ("model", "optimizer", "scheduler", "step", "data"):
        assert _same(a[key], b[key]), key
    assert b["data"] == {"epoch": 0, "samples": 5 * 32 * 2} and b["scheduler"]["last_epoch"] == 4


def test_deferred_skip_skips_the_same_updates(tmp_path):
    now_run = _poisoned_run(tmp_path, "each", "skip", "each-step")
    later_run = _poisoned_run(tmp_path, "deferred", "skip", "deferred")
    for run in (now_run, later_run):
        assert events_of(run, "status")[-1]["state"] == "finished"
    steps_now, steps_later = events_of(now_run, "step"), events_of(later_run, "step")
    assert [s["skipped"] for s in steps_now] == [0, 2, 0, 0]  # steps 3, 6, 9, 12
    assert [s["skipped"] for s in steps_later] == [0, 2, 0, 0]
    assert [s["loss"] for s in steps_later] == [s["loss"] for s in steps_now]
    assert _same(_checkpoint(now_run, 12)["model"], _checkpoint(later_run, 12)["model"])


def test_the_check_is_deferred_only_on_cuda_with_a_fused_optimizer_and_no_scaler(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    p = [torch.nn.Parameter(torch.zeros(2))]
    fused = torch.optim.AdamW(p, fused=True)
    foreach = torch.optim.AdamW(p, foreach=True)
    assert deferrable(fused, None, "cuda")
    assert not deferrable(fused, None, "cpu")
    assert not deferrable(foreach, None, "cuda")
    assert not deferrable(fused, object(), "cuda")  # fp16: the GradScaler's business
    monkeypatch.setenv(ENV, "each-step")
    assert not deferrable(fused, None, "cuda")
    monkeypatch.setenv(ENV, "deferred")
    assert deferrable(fused, None, "cpu") and not deferrable(foreach, None, "cpu")


def test_a_deferred_guard_gates_updates_on_the_device_and_settles_later(monkeypatch):
    monkeypatch.setenv(ENV, "deferred")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)

    class Position:
        epoch, samples = 0, 0

    guard = Guard("stop", opt, None, torch.device("cpu"))
    assert guard.deferred
    norms = [1.0, float("nan"), 2.0]  # the latch holds after the bad one
    kept = None
    for i, norm in enumerate(norms):
        Position.samples = i + 1
        w.grad = torch.full((4,), 0.5)
        assert guard.bad_now(torch.tensor(norm), torch.tensor(0.0), Position) is False
        opt.step()
        if i == 0:
            kept = w.detach().clone()
    assert torch.equal(w.detach(), kept)
    assert opt.state[w]["step"].item() == 1.0
    settled = guard.settle()
    assert settled.trip is not None
    assert (settled.trip.steps_back, settled.trip.position) == (2, (0, 2))
    assert guard.settle().trip is None  # read once


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("back", [1, 3, 7])
def test_rewinding_the_schedule_equals_never_taking_the_steps(back):
    cfg = TrainConfig(max_steps=20, warmup_steps=5, lr=1e-3)

    def sched():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))

    ahead, behind = sched(), sched()
    for _ in range(10):
        ahead.step()
    for _ in range(10 - back):
        behind.step()
    rewind_schedule(ahead, back)
    assert ahead.state_dict() == behind.state_dict()
    assert ahead.optimizer.param_groups[0]["lr"] == behind.optimizer.param_groups[0]["lr"]
