"""An optimizer that steps with a closure (LBFGS) through the engine (closure_step.py), or
from a task's own ``train_step`` (``optimizers.step(name, closure=...)``, task_step.py): each
evaluation averages the gradients and the loss over the ranks, so 2 CPU ranks give what 1
rank gives with the same global batch, to float rounding. Real torchrun."""

from __future__ import annotations

import pytest
from conftest import events_of, task_profile
from harness import run_engine

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

LBFGS_TASK = """
import torch
from gpu_console.tasks.mlp import MLPTask


class Lbfgs(MLPTask):
    def configure_optimizers(self, model, ctx):
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=4)
"""

# The same LBFGS stepped from the task's own train_step; the step reports the loss before
# the update (the closure's first evaluation), as the engine's own step does.
OWN_STEP_TASK = (
    LBFGS_TASK
    + """

class OwnStep(Lbfgs):
    def train_step(self, model, batch, optimizers, ctx):
        outputs = []

        def closure():
            out = self.compute(model, batch)
            optimizers.backward(out.loss, "main")
            outputs.append(out)
            return out.loss

        optimizers.step("main", closure=closure)
        return outputs[0]
"""
)

SETS = ["train.precision=fp64", "train.clip_grad_norm=0"]  # as a script: no clipping


def _losses(tmp_path, name: str, ranks: int, batch: int, cls: str = "Lbfgs") -> list[float]:
    source = OWN_STEP_TASK if cls == "OwnStep" else LBFGS_TASK
    profile = task_profile(tmp_path, "lbfgs", source, cls, max_steps=6)
    run = run_engine(tmp_path, profile, *SETS, f"data.batch_size={batch}", ranks=ranks,
                     runs_dir=tmp_path / name)  # fmt: skip
    start = events_of(run, "start")[0]
    assert start["train_step"] == ("task" if cls == "OwnStep" else "engine (closure)")
    assert start["optimizer"].startswith("LBFGS")
    return [e["loss"] for e in events_of(run, "step")]


def test_lbfgs_on_two_ranks_equals_one_rank_with_the_global_batch(tmp_path):
    one = _losses(tmp_path, "one", 1, 64)
    two = _losses(tmp_path, "two", 2, 32)
    assert len(one) == len(two) == 6
    assert two == pytest.approx(one, rel=1e-9, abs=0)
    assert one[-1] < one[0]  # it learns: LBFGS's steps went through


def test_a_closure_optimizer_beside_another_is_refused_in_one_line():
    import torch

    from gpu_console.engine import closure_step
    from gpu_console.engine.optim_set import Optimizers, OptimizerSetupError

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    both = {
        "a": torch.optim.LBFGS(model[0].parameters()),
        "b": torch.optim.SGD(model[1].parameters(), lr=0.1),
    }
    with pytest.raises(OptimizerSetupError, match="must be the task's only one"):
        closure_step.check(Optimizers.from_task(both, model), None)
    alone = Optimizers.from_task(torch.optim.LBFGS(model.parameters()), model)
    with pytest.raises(OptimizerSetupError, match="fp16's loss scaling"):
        closure_step.check(alone, object())
    assert closure_step.needs_closure(alone.first)
    assert not closure_step.needs_closure(torch.optim.SGD(model.parameters(), lr=0.1))


def test_lbfgs_from_a_tasks_own_step_on_two_ranks_equals_one_rank(tmp_path):
    one = _losses(tmp_path, "one", 1, 64, "OwnStep")
    two = _losses(tmp_path, "two", 2, 32, "OwnStep")
    assert len(one) == len(two) == 6
    assert two == pytest.approx(one, rel=1e-9, abs=0)
    assert one[-1] < one[0]
    # The task's closure makes the engine's own closure step's evaluations, in its order.
    engine = _losses(tmp_path, "engine", 1, 64)
    assert one == pytest.approx(engine, rel=1e-12, abs=0)


def test_a_closure_step_says_what_it_needs():
    import torch

    from gpu_console.engine.optim_set import Optimizers
    from gpu_console.engine.task_step import StepOptimizers

    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    x = torch.randn(8, 3, dtype=torch.float64)
    opts = Optimizers.from_task(torch.optim.LBFGS(model.parameters(), max_iter=3), model)

    def stepper(accum: int = 1) -> StepOptimizers:
        return StepOptimizers(opts, torch.device("cpu"), 1, accum, float("inf"), True, None)

    def closure(s: StepOptimizers):
        def fn():
            loss = model(x).square().mean()
            s.backward(loss, "main")
            return loss

        return fn

    s = stepper()
    with pytest.raises(TypeError, match=r"LBFGS steps with a closure: optimizers.step\('main'"):
        s.step("main")
    before = model.weight.detach().clone()
    s.step("main", closure=closure(s))
    assert not torch.equal(before, model.weight), "LBFGS stepped"
    assert all(q.grad is None for q in model.parameters()), "gradients set to None after"
    _, norms, skipped = s.finish()
    assert set(norms) == {"main"} and skipped == 0
    s = stepper(accum=2)
    with pytest.raises(ValueError, match=r"needs train.grad_accum = 1 .*got 2"):
        s.step("main", closure=closure(s))


def test_a_closure_optimizer_in_a_tasks_own_step_is_checked_before_the_first_step():
    from types import SimpleNamespace

    import torch

    from gpu_console.engine.optim_set import Optimizers, OptimizerSetupError
    from gpu_console.engine.task_step import TaskStep

    model = torch.nn.Linear(3, 1)
    opts = Optimizers.from_task(torch.optim.LBFGS(model.parameters()), model)
    d = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    train = SimpleNamespace(grad_accum=2, clip_grad_norm=0.0, nan_policy="skip")
    with pytest.raises(OptimizerSetupError, match=r"'main' steps with a closure: needs "
                       r"train.grad_accum = 1 \(got 2\)"):  # fmt: skip
        TaskStep(object(), opts, train, d, None, None, None)
    train.grad_accum = 1
    with pytest.raises(OptimizerSetupError, match="not under fp16's loss scaling"):
        TaskStep(object(), opts, train, d, object(), None, None)
