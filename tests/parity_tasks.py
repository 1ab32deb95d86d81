"""The update paths of the parity matrix (tests/test_parity_matrix.py), on the MLP and on the
mixture of experts: the engine's own step (``compute``), a closure optimizer through the
engine (LBFGS), the task's own ``train_step`` stepping through ``optimizers.step``, and one
that calls the torch optimizer's ``step()`` itself. Task kinds ``parity_tasks:<Class>``."""

from __future__ import annotations

import torch

from gpu_console.tasks.mlp import MLPTask
from gpu_console.tasks.moe import MoETask


class Closure:
    """An optimizer that steps with a closure: the engine reruns the step's batches in it."""

    def configure_optimizers(self, model, ctx):
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=3)


class OwnStep:
    """The task's own step, through the engine's ``optimizers.step`` (it averages the
    gradients over the ranks)."""

    def train_step(self, model, batch, optimizers, ctx):
        out = self.compute(model, batch)
        optimizers.backward(out.loss, "main")
        optimizers.step("main")
        return out


class RawStep:
    """The task's own step calling the torch optimizer itself: nothing averages its gradients
    over the ranks."""

    def train_step(self, model, batch, optimizers, ctx):
        out = self.compute(model, batch)
        optimizers.backward(out.loss, "main")
        optimizers["main"].step()
        optimizers["main"].zero_grad(set_to_none=True)
        return out


class MlpEngine(MLPTask):
    pass


class MlpClosure(Closure, MLPTask):
    pass


class MlpOwnStep(OwnStep, MLPTask):
    pass


class MlpRawStep(RawStep, MLPTask):
    pass


class MoeEngine(MoETask):
    pass


class MoeClosure(Closure, MoETask):
    pass


class MoeOwnStep(OwnStep, MoETask):
    pass


class MoeRawStep(RawStep, MoETask):
    pass
