"""Optimizers and schedules: a task's own (``configure_optimizers``) and the profile's
(``train.optimizer``, betas, momentum, the decay horizon and floor), run by the engine on 1
or 2 CPU ranks (the harness, tests/harness.py): what the start event says was built (and the
lines the headless console makes of it), what the checkpoint holds, and an exact resume with
two optimizers and a ReduceLROnPlateau. The launch's refusals go through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST_RUN_STEPS, events_of, fast_profile, task_profile
from harness import run_engine
from rich.console import Console
from torch import nn

from gpu_console.engine import checkpoint
from gpu_console.engine.optim_set import Optimizers, OptimizerSetupError
from gpu_console.engine.schedule import lr_factor
from gpu_console.headless import _notable
from gpu_console.profile import ProfileError, TrainConfig, resolve

GAN = (Path(__file__).parent / "gan_task.py").read_text()
EVAL_EVERY = 3


def gan_profile(tmp_path: Path, max_steps: int = 24) -> Path:
    extra = "[checkpoint]\nkeep_last = 0\n"
    profile = task_profile(
        tmp_path, "gan_task", GAN, "GanTask", max_steps=max_steps, extra=extra, ranks=2
    )
    text = profile.read_text().replace("log_every = 1", f"log_every = 1\neval_every = {EVAL_EVERY}")
    profile.write_text(text.replace("train_samples = 8192\neval_samples = 512\n", ""))
    profile.write_text(profile.read_text().replace("hidden_dim = 64\n", ""))
    return profile


def finished(tmp_path: Path, profile: Path | None, name: str, *sets: str, **kw) -> Path:
    """The profile run to its end on 2 ranks under ``tmp_path/name`` (or a resume)."""
    done = run_engine(tmp_path, profile, *sets, ranks=2, runs_dir=tmp_path / name, **kw)
    assert events_of(done, "status")[-1]["state"] == "finished"
    return done


def steps_of(run: Path) -> dict[int, tuple]:
    return {e["step"]: (e["loss"], e["lrs"]["g"], e["lrs"]["d"]) for e in events_of(run, "step")}


def test_two_optimizers_are_built_checkpointed_and_resume_exactly(tmp_path):
    profile = gan_profile(tmp_path)
    ref = finished(tmp_path, profile, "ref")
    expected = steps_of(ref)
    assert len(expected) == 24

    start = events_of(ref, "start")[0]
    # The headless console's start lines say what was built.
    shown = Console(record=True, width=200)
    _notable(start, shown)
    assert shown.export_text().splitlines()[1:] == [
        "  optimizer g: Adam (default), 1 group, lr 0.002, schedule function",
        "  optimizer d: SGD (default), 2 groups, lr 0.02, schedule ReduceLROnPlateau on eval loss",
    ]
    assert start["optimizer"] == "g: Adam (default), d: SGD (default)"
    assert start["train_step"] == "engine"
    assert start["lr"] is None  # the profile's lr runs nothing here: each optimizer has its own
    g, d = start["optimizers"]
    assert (g["name"], g["class"], g["schedule"]) == ("g", "Adam", {"kind": "function"})
    assert g["param_groups"] == [
        {"tensors": 2, "params": 4 * 32 + 32, "lr": 2e-3, "weight_decay": 0.0}
    ]
    assert (d["name"], d["class"]) == ("d", "SGD")
    assert d["schedule"] == {"kind": "ReduceLROnPlateau", "monitor": "loss"}
    # The task saw the context: its lr is 1e-2 × world size; the head's group has its own.
    assert [(x["lr"], x["weight_decay"], x["tensors"]) for x in d["param_groups"]] == [
        (2e-2, 1e-4, 2),
        (2e-2, 0.0, 2),
    ]
    # Each schedule moved its own optimizer (a step event's lr is the next update's): g warms
    # up over 4 steps, the plateau cuts d's lr.
    assert [expected[s][1] for s in (1, 2, 3, 4, 10)] == pytest.approx(
        [1e-3, 1.5e-3, 2e-3, 2e-3, 2e-3]
    )
    assert expected[1][2] == 2e-2 and expected[24][2] < 2e-2
    evals = events_of(ref, "eval")
    assert [e["step"] for e in evals] == list(range(EVAL_EVERY, 25, EVAL_EVERY))

    # Every optimizer and schedule is in the checkpoint, by name.
    state = checkpoint.load(ref / "checkpoints" / "step-00000024")
    assert sorted(state["optimizers"]) == ["d", "g"] and sorted(state["schedulers"]) == ["d", "g"]
    assert state["optimizers"]["d"]["param_groups"][0]["momentum"] == 0.9
    assert state["optimizers"]["g"]["param_groups"][0]["betas"] == (0.5, 0.999)
    assert state["schedulers"]["d"]["num_bad_epochs"] is not None

    # Half the run, then a resume to the end: the same losses and lrs, bit for bit.
    half = finished(tmp_path, profile, "b", "train.max_steps=12")
    assert max(steps_of(half)) == 12
    finished(tmp_path, None, "b", "train.max_steps=24", resume=half)
    assert events_of(half, "start")[1]["start_step"] == 12
    assert steps_of(half) == expected
    assert [e["loss"] for e in events_of(half, "eval")] == [e["loss"] for e in evals]


def test_the_profile_chooses_sgd_or_adam_and_the_run_builds_it(tmp_path):
    profile = fast_profile(tmp_path, max_steps=2)
    sgd = ["train.optimizer=sgd", "train.momentum=0.8", "train.nesterov=true",
           "train.weight_decay=0.05"]  # fmt: skip
    done = run_engine(tmp_path, profile, *sgd, runs_dir=tmp_path / "sgd")
    start = events_of(done, "start")[0]
    assert start["optimizer"] == "SGD (fused)"
    (main,) = start["optimizers"]
    assert main["name"] == "main" and main["class"] == "SGD"
    assert main["schedule"]["kind"] == "cosine"
    assert [g["weight_decay"] for g in main["param_groups"]] == [0.05, 0.0]
    groups = checkpoint.load(done / "checkpoints" / "step-00000002")["optimizers"]["main"]
    assert {(g["momentum"], g["nesterov"]) for g in groups["param_groups"]} == {(0.8, True)}
    assert all("momentum_buffer" in s for s in groups["state"].values())

    adam = ["train.optimizer=adam", "train.betas=[0.8, 0.95]", "train.eps=1e-6"]
    done = run_engine(tmp_path, profile, *adam, runs_dir=tmp_path / "adam")
    assert events_of(done, "start")[0]["optimizers"][0]["class"] == "Adam"
    groups = checkpoint.load(done / "checkpoints" / "step-00000002")["optimizer"]["param_groups"]
    assert {(tuple(g["betas"]), g["eps"]) for g in groups} == {((0.8, 0.95), 1e-6)}


def test_dry_run_shows_the_tasks_optimizers(procs, runs_dir, tmp_path):
    profile = gan_profile(tmp_path)
    result = procs.cli("run", str(profile), "--dry-run", "--json", "--runs-dir", str(runs_dir),
                       cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(result.stdout)
    assert [(o["name"], o["class"]) for o in plan["optimizers"]] == [("g", "Adam"), ("d", "SGD")]
    assert plan["schedule"] is None
    text = procs.cli("run", str(profile), "--dry-run", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert "optimizer d  SGD (default), schedule ReduceLROnPlateau on eval loss" in text.stdout


# -- the profile's keys, the schedule, the hook's checks (no torchrun) -----------------------


def test_bad_optimizer_keys_are_one_line_each():
    with pytest.raises(ProfileError) as e:
        resolve({"train": {"nesterov": True, "betas": [0.9], "min_lr": 1.0}}, "p.toml")
    assert e.value.problems == [
        "p.toml: train.betas: expected two numbers in [0, 1) (got [0.9])",
        "p.toml: train.nesterov: needs train.optimizer = 'sgd' and train.momentum > 0 "
        "(got optimizer 'adamw', momentum 0)",
        "p.toml: train.min_lr: must not exceed train.lr=0.001 (got 1)",
    ]


def test_decay_horizon_and_floor():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, schedule="linear", lr=1e-3,
                      lr_decay_steps=20, min_lr=1e-4)  # fmt: skip
    assert lr_factor(10, cfg) == 1.0
    assert lr_factor(20, cfg) == pytest.approx(0.55)  # half-way down to the floor
    assert [lr_factor(s, cfg) for s in (30, 60, 99)] == pytest.approx([0.1] * 3)
    # min_lr_ratio and min_lr: the higher floor wins.
    assert lr_factor(
        50, TrainConfig(lr=1e-3, min_lr=1e-4, min_lr_ratio=0.2, lr_decay_steps=9)
    ) == pytest.approx(0.2)


def test_a_checkpoint_from_before_several_optimizers_loads_into_main():
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    old = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back = Optimizers.single(fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 0.5))
    back.load_state_dict(old)
    assert torch.equal(fresh.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert back.entries[0].scheduler.last_epoch == 1


def test_a_parameter_in_no_optimizer_or_in_two_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(OptimizerSetupError, match="2 trainable parameters are in no optimizer"):
        Optimizers.from_task(first, model)
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptimizerSetupError, match="is in optimizers 'a' and 'b'"):
        Optimizers.from_task({"a": first, "b": both}, model)


def test_a_tasks_own_gan_step_is_averaged_and_resumes_exactly(tmp_path):
    profile = gan_profile(tmp_path)
    text = profile.read_text().replace("GanTask", "GanStepTask")
    profile.write_text(text.replace("max_steps = 24", "max_steps = 24\ngrad_accum = 2"))
    # Every step the task checks that the ranks hold the same weights (see gan_task.py).
    ref = finished(tmp_path, profile, "ref")
    expected = steps_of(ref)
    assert len(expected) == 24
    # StepLR halves d's lr every 5 steps; g warms up over 4.
    assert [expected[s][2] for s in (4, 5, 10, 24)] == pytest.approx([2e-3, 1e-3, 5e-4, 1.25e-4])
    assert expected[1][1] == pytest.approx(5e-4) and expected[24][1] == pytest.approx(1e-3)
    steps = events_of(ref, "step")
    assert set(steps[-1]["grad_norms"]) == {"d", "g"}
    assert events_of(ref, "start")[0]["train_step"] == "task"
    state = checkpoint.load(ref / "checkpoints" / "step-00000024")
    assert state["schedulers"]["d"]["last_epoch"] == 24

    half = finished(tmp_path, profile, "b", "train.max_steps=12")
    finished(tmp_path, None, "b", "train.max_steps=24", resume=half)
    assert steps_of(half) == expected


def test_a_resume_cannot_change_the_optimizer(fast_run, procs, tmp_path):
    run = fast_run.copy(tmp_path / "copied")  # the session's finished fast run, ours to resume
    more = f"train.max_steps={FAST_RUN_STEPS + 2}"
    result = procs.cli(
        "run", "--resume", str(run), "--headless", "--set", "train.optimizer=sgd",
        "--set", more, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(
        "gpu-console: --set: train.optimizer: a resumed run cannot change it (was 'adamw')"
    )
    assert len(events_of(run, "start")) == 1
