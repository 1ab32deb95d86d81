"""An optimizer stepped outside the engine's update, on several ranks: refused, not silent.

On two or more ranks the engine averages each optimizer's gradients over the ranks just
before it steps it (DDP in the engine's own step, ``optimizers.step`` in a task's own
``train_step``). A task that calls ``step()`` itself (a plain LBFGS script's
``optimizer.step(closure)`` ported as it is) steps on this rank's gradients alone: every
rank then trains its own copy of the model, exit 0, no word. A global step pre-hook sees
every optimizer step of the rank; one over the model's parameters that the engine is not
making raises :class:`~.refusal.Refused` before it changes anything, on every rank at the
same call. On one rank nothing is averaged, so such a step is what a script does, and no
hook is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .refusal import Refused


class StepWatch:
    """The optimizers the engine is stepping now, and the hook that refuses any other."""

    def __init__(self) -> None:
        # Engine steps in progress: any optimizer step inside one is the engine's (a wrapper,
        # ZeroRedundancyOptimizer or Lookahead, steps the optimizer it wraps).
        self._depth = 0
        self._hook: Any = None

    def install(self, entries, world_size: int, key: str) -> None:
        """On several ranks: refuse a step of an optimizer over the model's parameters (the
        engine's ``entries`` cover every trainable one) that the engine did not make.
        ``key``: where the task makes its updates (``task.train_step``, ``task.compute``)."""
        if world_size < 2 or self._hook is not None:
            return
        names = {id(e.optimizer): e.name for e in entries}

        def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._depth:
                return
            name = names.get(id(optimizer))
            if name is None and not _of_model(optimizer, entries):
                return  # the task's own optimizer of something else (not the model)
            raise Refused(key, _problem(optimizer, name, world_size, key))

        self._hook = register_optimizer_step_pre_hook(check)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextlib.contextmanager
    def engine(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """The engine's own step of ``optimizer`` (its averaged gradients), and every step
        it makes of other optimizers (those it wraps)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


def _of_model(optimizer: torch.optim.Optimizer, entries) -> bool:
    """Whether ``optimizer`` updates any of the model's parameters (the engine's optimizers
    cover every trainable one; read now: FSDP puts its shards in their place after this
    watch is installed)."""
    model = {id(q) for e in entries for q in e.params}
    return any(id(q) in model for g in optimizer.param_groups for q in g["params"])


def _problem(optimizer, name: str | None, world_size: int, key: str) -> str:
    from .closure_step import needs_closure  # it imports optim_set, which imports this

    cls = type(optimizer).__name__
    what = f"optimizer {name!r} ({cls})" if name else f"an optimizer ({cls}) of the model"
    if key.endswith("compute"):
        instead = "return the loss from compute (or a train_step) and let the engine step it"
    else:
        use = name or "main"
        closure = ", closure=fn" if needs_closure(optimizer) else ""
        step = f"optimizers.step({use!r}{closure})"
        instead = (
            "step it through the optimizers train_step is handed: "
            f"optimizers.backward(loss, {use!r}), then {step}"
        )
    return (
        f"{what} was stepped by the task itself on {world_size} ranks, where nothing averages "
        f"its gradients over the ranks (each would train its own model); {instead} "
        "(docs/tasks.md)"
    )
