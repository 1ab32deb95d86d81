"""One way to make a task's parts, in the order docs/tasks.md promises, on every path.

The order (docs/tasks.md, docs/reproducibility.md): ``task.ctx`` is set; ``build_model()``
runs under ``torch.manual_seed(train.seed)``; then the optimizers (``configure_optimizers``,
else ``param_groups``, else the profile's); then ``build_datasets()``, all from that one
random stream. A task may rely on it: a ``build_datasets`` that reads what ``build_model``
set (a vocabulary, a tokenizer, ``self.train_set``) is a working task.

Every path that makes a task's parts goes through :class:`TaskParts`: the ranks (build.py),
``--dry-run`` and a launch's data check (plan.py), a resume's model check (model_match.py).
A path may stop early (the model check needs no data) but cannot skip or reorder a step:
asking for the data sets before the optimizers is an :class:`OutOfOrder` error, a bug of the
path, never of the task. ``tests/test_task_order.py`` records the task's calls on each path
and holds them against :data:`ORDER`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .hooks import attach

# The task's calls, as docs/tasks.md states them ("ctx" is the attribute the engine sets).
ORDER = ("ctx", "build_model", "configure_optimizers", "build_datasets")


class OutOfOrder(RuntimeError):
    """A path of the engine asked for a part before the parts the contract puts first."""


def _plain(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class TaskParts:
    """The parts of one task, each made once, in :data:`ORDER`.

    ``call(what, fn, *args)`` runs each of the task's methods: a path that reports a task's
    failure in one line (plan.py: "build_model() failed: ...") passes its own.
    """

    def __init__(
        self,
        task: Any,
        ctx: Any,
        seed: int,
        call: Callable[..., Any] = _plain,
    ) -> None:
        self.task = task
        self.ctx = ctx
        self._seed = seed
        self._call = call
        self._model: nn.Module | None = None
        self._optimizers: Any = None
        self._datasets: tuple[Any, Any] | None = None
        attach(task, ctx)  # before build_model, on every path (not yet in __init__)

    @property
    def built_model(self) -> nn.Module:
        if self._model is None:
            raise OutOfOrder("the model is asked for before build_model() ran")
        return self._model

    def model(
        self,
        then: Callable[[nn.Module], nn.Module] | None = None,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """``build_model()`` under ``torch.manual_seed(train.seed)`` (the same weights on every
        rank), inside ``with torch.device(device)`` when one is given (the meta device of a
        shape check); ``then``: what the path does to it next (to its device, cast)."""
        if self._model is not None:
            return self._model
        torch.manual_seed(self._seed)
        where = torch.device(device) if device is not None else contextlib.nullcontext()
        with where:
            model = self._call("build_model()", self.task.build_model)
        self._model = then(model) if then is not None else model
        return self._model

    def optimizers(self, build: Callable[[nn.Module], Any]) -> Any:
        """The optimizers, made by ``build(model)`` (optim_set.Optimizers.build: the task's
        ``configure_optimizers``, else its ``param_groups``, else the profile's)."""
        if self._optimizers is None:
            model = self.built_model
            self._optimizers = self._call("configure_optimizers()", build, model)
        return self._optimizers

    def datasets(self) -> tuple[Any, Any]:
        """``build_datasets()``: ``(train, eval)``, once the model and optimizers are made."""
        if self._datasets is None:
            if self._optimizers is None:
                raise OutOfOrder("build_datasets() is asked for before the optimizers are made")
            self._datasets = self._call("build_datasets()", self.task.build_datasets)
        return self._datasets
