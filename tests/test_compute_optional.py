"""``compute`` is optional for a task that trains through its own ``train_step`` and has no
eval data (issue 26): nothing else calls it but the FLOPs count. Eval data without it is
refused before launch, in one line naming ``task.kind`` (the CLI's refusal); the run itself
is the engine's, in the harness (tests/harness.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import events_of, write_profile
from harness import run_engine

from gpu_console.engine import activation_checkpoint, flops
from gpu_console.peaks import Peak
from gpu_console.tasks.base import batch_collate
from gpu_console.tasks.loader import TaskLoadError, load_task_class

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

STEP_ONLY = """
from dataclasses import dataclass

import torch
from torch import nn

from gpu_console.tasks.base import TaskOutput, TensorSet


@dataclass
class Config:
    eval_data: bool = False


class StepOnly:
    Config = Config

    def __init__(self, config):
        self.cfg = config

    def build_model(self):
        return nn.Linear(4, 1)

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 4, generator=g)
        y = x.sum(dim=1, keepdim=True)
        return TensorSet(x, y), (TensorSet(x[:64], y[:64]) if self.cfg.eval_data else None)

    def train_step(self, model, batch, optimizers, ctx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizers.backward(loss, "main")
        optimizers.step("main")
        return TaskOutput(loss=loss.detach(), samples=len(x))


class Neither:  # neither compute nor train_step
    Config = Config
    __init__ = StepOnly.__init__
    build_model = StepOnly.build_model
    build_datasets = StepOnly.build_datasets
"""


def step_only_profile(tmp_path, eval_data: bool = False, extra: str = ""):
    (tmp_path / "steponly.py").write_text(STEP_ONLY)
    return write_profile(
        tmp_path / "steponly.toml",
        f"""
[profile]
name = "steponly"
[task]
kind = "steponly:StepOnly"
eval_data = {str(eval_data).lower()}
[data]
batch_size = 16
[train]
max_steps = 6
lr = 1e-2
log_every = 1
precision = "fp32"
{extra}
[hardware]
devices = "cpu:1"
""",
    )


def test_a_task_needs_compute_or_train_step(tmp_path, monkeypatch):
    (tmp_path / "steponly.py").write_text(STEP_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task_class("steponly:StepOnly").__name__ == "StepOnly"
    with pytest.raises(TaskLoadError) as e:
        load_task_class("steponly:Neither")
    assert str(e.value) == (
        "task.kind: steponly:Neither lacks compute (or train_step) (got 'steponly:Neither')"
    )


def step_only_task(tmp_path, monkeypatch):
    (tmp_path / "steponly.py").write_text(STEP_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = load_task_class("steponly:StepOnly")
    return cls(cls.Config())


def test_without_compute_flops_and_held_bytes_say_why_they_are_not_measured(tmp_path, monkeypatch):
    # A GPU in the peak table (faked: this machine may have none), where MFU would be shown.
    known = Peak("H100", "fp32", 1e12, "test")
    monkeypatch.setattr(flops, "_peak", lambda device, precision: (known, None))
    task = step_only_task(tmp_path, monkeypatch)
    model = task.build_model()
    train, _ = task.build_datasets()
    loader = torch.utils.data.DataLoader(train, batch_size=8, collate_fn=batch_collate)
    got = flops.setup(task, model, loader, "fp32", 2, contextlib.nullcontext(),
                      lambda b, d: b, True, True)  # fmt: skip
    assert (got.flops, got.flops_from) == (None, "unknown")
    assert got.why_not == (
        "the task has no compute() to measure (declare flops_per_sample): MFU not shown"
    )
    with pytest.raises(activation_checkpoint.NotMeasured, match="no compute"):
        activation_checkpoint.held_bytes(task, model, next(iter(loader)), contextlib.nullcontext())


def test_a_train_step_task_without_compute_trains_without_a_flops_count(tmp_path):
    # measure_flops = true asks for the count that needs compute: the run goes on without it.
    profile = step_only_profile(tmp_path, extra="measure_flops = true")
    run = run_engine(tmp_path, profile)
    assert events_of(run, "status")[-1]["state"] == "finished"
    [start] = events_of(run, "start")
    assert start["train_step"] == "task"
    assert (start["flops_per_sample"], start["flops_from"]) == (None, "unknown")
    assert [e["step"] for e in events_of(run, "step")] == [1, 2, 3, 4, 5, 6]
    assert not events_of(run, "eval")


@pytest.mark.parametrize("dry_run", [False, True], ids=["launch", "dry-run"])
def test_eval_data_without_compute_is_refused_before_launch(procs, runs_dir, tmp_path, dry_run):
    profile = step_only_profile(tmp_path, eval_data=True)
    args = ["run", str(profile), "--headless", "--runs-dir", str(runs_dir)]
    result = procs.cli(*args, *(["--dry-run"] if dry_run else []), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "task.kind: steponly:StepOnly returns eval data" in lines[0], lines
    assert "no compute(model, batch)" in lines[0], lines
    assert "Traceback" not in result.stdout + result.stderr
    assert not runs_dir.exists() or not list(runs_dir.iterdir())
