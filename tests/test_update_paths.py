"""The paths that trained silently wrong on two ranks (issue 39), run by the engine on 1 or 2
CPU ranks (the harness, tests/harness.py).

- A task that steps its optimizer itself in ``train_step`` (a plain LBFGS script's loop,
  ported as it is): on one rank it trains as the script does; on two, nothing would average
  its gradients, so the step is refused before it changes anything (engine/step_watch.py).
- ``expert_parameters`` with the task's own ``train_step``: its ``optimizers.step`` averages
  by the strategy's rule (the experts left to their own), so 2 ranks equal the engine's own
  step on 2 ranks, in fp64.
- ``nan_policy = "stop"`` under a task's own step stops as under the engine's: the same
  failure line, the same checkpoint of the last finite state.
"""

from __future__ import annotations

import pytest
import torch
from conftest import events_of, task_profile, write_profile
from harness import run_engine

from gpu_console.engine.optim_set import Optimizers
from gpu_console.engine.refusal import Refused

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

SCRIPT_STEP_TASK = """
import torch
from gpu_console.tasks.mlp import MLPTask


class ScriptStep(MLPTask):
    def configure_optimizers(self, model, ctx):
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=4)

    # A plain LBFGS script's loop, ported as it is: its own zero_grad, backward and step().
    def train_step(self, model, batch, optimizers, ctx):
        opt = optimizers["main"]
        outputs = []

        def closure():
            opt.zero_grad()
            out = self.compute(model, batch)
            out.loss.backward()
            outputs.append(out)
            return out.loss

        opt.step(closure)
        return outputs[0]
"""


def _run(tmp_path, profile, name: str, *sets: str, ranks: int = 1):
    """The run to its end; (how it ended: its last status event, the run)."""
    run = run_engine(tmp_path, profile, *sets, ranks=ranks, runs_dir=tmp_path / name)
    return events_of(run, "status")[-1], run


def test_a_task_stepping_its_own_optimizer_is_refused_on_two_ranks(tmp_path):
    profile = task_profile(tmp_path, "script_step", SCRIPT_STEP_TASK, "ScriptStep", max_steps=4)
    one, run = _run(tmp_path, profile, "one")
    assert one["state"] == "finished", one  # one rank: what the script does
    losses = [e["loss"] for e in events_of(run, "step")]
    assert len(losses) == 4 and losses[-1] < losses[0]

    # The ranks' refusal is recorded by the loop as state "refused" (the supervisor makes it
    # exit 2, and the headless console says "state: refused" and the line: engine/refusal.py).
    two, run = _run(tmp_path, profile, "two", ranks=2)
    assert two["state"] == "refused", two
    line = two["reason"]
    assert (
        "task.train_step: optimizer 'main' (LBFGS) was stepped by the task itself on 2 ranks"
        in line
    )
    assert "optimizers.backward(loss, 'main'), then optimizers.step('main', closure=fn)" in line
    assert "\n" not in line
    assert events_of(run, "step") == []  # refused before its first update


def test_only_a_step_of_the_models_optimizers_outside_the_engine_is_refused():
    model = torch.nn.Linear(3, 1)
    opts = Optimizers.from_task(torch.optim.SGD(model.parameters(), lr=0.1), model)
    one = Optimizers.from_task(torch.optim.SGD(model.parameters(), lr=0.1), model)
    one.watch.install(one.entries, 1, "task.train_step")  # one rank: nothing to refuse
    one.first.step()
    opts.watch.install(opts.entries, 2, "task.train_step")
    try:
        model(torch.ones(2, 3)).sum().backward()
        before = model.weight.detach().clone()
        with pytest.raises(Refused, match=r"^task.train_step: optimizer 'main' \(SGD\) was "):
            opts.first.step()
        assert torch.equal(model.weight, before)  # refused before it changed anything
        opts.step(None)  # the engine's own step
        assert not torch.equal(model.weight, before)
        # An optimizer the task built itself over the model is refused too; one of
        # something else (not the model) is the task's business.
        with pytest.raises(Refused, match=r"an optimizer \(Adam\) of the model"):
            torch.optim.Adam(model.parameters()).step()
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1).step()
    finally:
        opts.watch.remove()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the hook is gone
    # The engine's own step (no train_step): the task is told to let the engine step.
    own = Optimizers.from_task(torch.optim.SGD(model.parameters(), lr=0.1), model)
    own.watch.install(own.entries, 2, "task.compute")
    try:
        with pytest.raises(Refused, match=r"^task.compute: .*let the engine step it"):
            own.first.step()
    finally:
        own.watch.remove()


OWN_STEP_MOE = """
from gpu_console.tasks.moe import MoETask


class OwnStepMoE(MoETask):
    # The engine's own step, written as a task's: compute, backward, step.
    def train_step(self, model, batch, optimizers, ctx):
        out = self.compute(model, batch)
        optimizers.backward(out.loss, "main")
        optimizers.step("main")
        return out
"""

MOE_PROFILE = """
[profile]
name = "moe-{name}"
[task]
kind = "{kind}"
d_model = 32
n_heads = 2
num_experts = 4
seq_len = 32
expert_parallel = true
[data]
batch_size = 16
[train]
max_steps = 8
lr = 3e-3
warmup_steps = 2
log_every = 1
precision = "fp64"
clip_grad_norm = 0.05
[checkpoint]
every_steps = 0
at_end = false
[hardware]
devices = "cpu:2"
"""


def test_expert_parameters_with_a_train_step_equal_the_engines_step(tmp_path):
    (tmp_path / "own_moe.py").write_text(OWN_STEP_MOE)
    steps = {}
    for name, kind in (("engine", "moe"), ("task", "own_moe:OwnStepMoE")):
        profile = write_profile(tmp_path / f"{name}.toml", MOE_PROFILE.format(name=name, kind=kind))
        ended, run = _run(tmp_path, profile, name, ranks=2)
        assert ended["state"] == "finished", ended
        (start,) = events_of(run, "start")
        assert start["strategy"] == "expert"
        assert start["train_step"] == name
        steps[name] = events_of(run, "step")
    assert len(steps["engine"]) == len(steps["task"]) == 8
    # The clip (0.05) binds: the norm over every rank's experts scales every update.
    assert all(e["grad_norm"] > 0.05 for e in steps["engine"])
    # Measured: equal to the bit (the same reductions of the same fp64 numbers).
    for a, b in zip(steps["engine"], steps["task"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12, abs=0)
    assert steps["task"][-1]["loss"] < steps["task"][0]["loss"]


POISONED = """
from gpu_console.tasks.mlp import MLPTask


class Poisoned(MLPTask):
    calls = 0

    def compute(self, model, batch):
        out = super().compute(model, batch)
        if model.training:
            Poisoned.calls += 1
            if Poisoned.calls == 5:
                out.loss = out.loss * float("nan")
        return out


class OwnStep(Poisoned):
    def train_step(self, model, batch, optimizers, ctx):
        out = self.compute(model, batch)
        optimizers.backward(out.loss, "main")
        optimizers.step("main")
        return out
"""


def test_nan_stop_under_a_tasks_own_step_stops_as_the_engines(tmp_path):
    saved = {}
    for cls in ("Poisoned", "OwnStep"):
        profile = task_profile(tmp_path, "poisoned_step", POISONED, cls, max_steps=8)
        ended, run = _run(tmp_path, profile, cls, "train.nan_policy=stop")
        # The engine failed the run (the supervisor takes its reason as the failure's summary).
        assert ended["state"] == "failed", ended
        summary = ended["reason"]
        assert "loss is nan in step 5 (train.nan_policy = 'stop')" in summary
        assert "checkpoint step-00000004 holds the last finite state" in summary
        assert max(e["step"] for e in events_of(run, "step")) == 4
        ckpt = events_of(run, "checkpoint")[-1]
        assert (ckpt["step"], ckpt["reason"]) == (4, "nan")
        path = run / "checkpoints" / "step-00000004" / "state.pt"
        saved[cls] = torch.load(path, weights_only=True)
    engine, own = saved["Poisoned"], saved["OwnStep"]
    for name, value in engine["model"].items():
        assert torch.equal(own["model"][name], value), name
    assert engine["step"] == own["step"] and engine["data"] == own["data"]


@pytest.mark.parametrize("bucket_bytes", [1, 200, 1 << 20])
def test_the_task_steps_average_lands_every_bucket_where_it_came_from(one_rank_group, bucket_bytes):
    # One rank of a group told it is half of two: every gradient comes back halved, whatever
    # the buckets (one tensor each and in place, a few together, all in one), with more
    # buckets than are let in flight; a parameter without a gradient gets zeros.
    from gpu_console.engine.strategy_ddp import average

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))
              for shape in [(3, 4), (5,), (2, 2), (7, 3), (1,), (4, 4)]]  # fmt: skip
    for q in params:
        q.grad = torch.randn_like(q)
    params[2].grad = torch.randn(2, 2, dtype=torch.float64).t()  # not contiguous
    params[4].grad = None
    before = [None if q.grad is None else q.grad.clone() for q in params]
    average(params, 2, bucket_bytes)
    for q, g in zip(params, before, strict=True):
        assert torch.equal(q.grad, torch.zeros_like(q) if g is None else g * 0.5)
