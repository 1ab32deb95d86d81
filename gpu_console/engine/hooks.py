"""The task's optional hooks and state, called by the loop with one line at each place.

Every hook runs on every rank, at the same point of the run (so a hook may use
collectives), and gets the bare model (not the DDP wrapper; in train mode) and the
context (context.py). A task without a hook is not called for it. What a hook raises fails
the rank, as an exception in ``compute`` does, named (``the task's on_step_end hook failed:
...``); after an update, the post-step state is checkpointed first (failure_checkpoint.py).

- ``on_step_end(model, output, ctx)``: after each optimizer step (``ctx.step`` counts it);
  ``output`` is the last micro-batch's TaskOutput (its loss not divided by grad_accum).
- ``on_epoch_end(model, ctx)``: after the step that took the epoch's last batch
  (``ctx.epoch`` is the epoch that ended), after that step's ``on_step_end``.
- ``on_eval_start(model, ctx)``: before each eval (a task that carries state across eval
  batches resets it here).
- ``on_eval_end(model, metrics, ctx)``: after each eval, with its metrics reduced over
  every rank (the same dict on every rank). It may return ``{name: number}``: figures of its
  own (a score over several splits), added to the eval event and judged by
  ``checkpoint.keep_best`` like the eval's own.
- ``on_train_end(model, ctx, reason)``: once, when the run ends ``"finished"`` (max_steps),
  ``"stopped"`` (a stop command) or ``"signal"`` (a scheduler's signal): after the end (or
  stop) checkpoint, so what it changes is not saved and a resume goes on as if it had not
  run; before the final status. Not after a failure (``close()`` runs then).

State: ``state_dict()`` is called on every rank at each checkpoint and saved per rank in it;
``load_state_dict(state)`` gets this rank's state back on resume, after ``build_model`` and
``build_datasets``, before the first step. Tensors come back on the CPU. The state must be
what ``torch.load(weights_only=True)`` reads: tensors, numbers, strings, lists, dicts (a
numpy number is saved as its Python value; anything else fails the checkpoint: ``saveable``).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .context import TaskContext
from .data import Batches
from .failure_checkpoint import naming

if TYPE_CHECKING:
    from ..tasks.base import TaskOutput


def attach(task: Any, ctx: TaskContext) -> None:
    """Give the task its context (``task.ctx``) before the engine calls anything of it."""
    task.ctx = ctx


class Hooks:
    def __init__(self, task: Any, ctx: TaskContext):
        self.ctx = ctx
        self._step_end = getattr(task, "on_step_end", None)
        self._epoch_end = getattr(task, "on_epoch_end", None)
        self._eval_start = getattr(task, "on_eval_start", None)
        self._eval_end = getattr(task, "on_eval_end", None)
        self._train_end = getattr(task, "on_train_end", None)
        self._state_dict = getattr(task, "state_dict", None)
        self._load_state_dict = getattr(task, "load_state_dict", None)
        self._epochs = 0  # epochs whose on_epoch_end has run (or ran before a resume)

    def start(self, step: int, batches: Batches) -> None:
        """Where training starts (0, or a resumed step and data position)."""
        self.ctx.step = step
        if self.ctx.resumed:
            self.ctx.start_step = step
        self.ctx.epoch = batches.position.epoch
        self.ctx.batch_in_epoch = batches.batch_in_epoch()
        self._epochs = batches.epochs_done()

    def step_end(
        self, step: int, batches: Batches, model: torch.nn.Module, output: TaskOutput
    ) -> None:
        ctx = self.ctx
        ctx.step = step
        ctx.epoch = batches.position.epoch
        ctx.batch_in_epoch = batches.batch_in_epoch()
        if self._step_end is not None:
            with naming("the task's on_step_end hook"):
                self._step_end(model, output, ctx)
        done = batches.epochs_done()
        if done > self._epochs and self._epoch_end is not None:
            for ended in range(self._epochs, done):  # several when an epoch is one step long
                ctx.epoch = ended
                with naming("the task's on_epoch_end hook"):
                    self._epoch_end(model, ctx)
            ctx.epoch = batches.position.epoch
        self._epochs = done

    def eval_start(self, model: torch.nn.Module) -> None:
        if self._eval_start is not None:
            self._eval_start(model, self.ctx)

    def eval_end(self, model: torch.nn.Module, metrics: dict[str, float]) -> dict[str, float]:
        """The figures the hook adds to the eval's (none without the hook)."""
        if self._eval_end is None:
            return {}
        return added_figures(self._eval_end(model, dict(metrics), self.ctx), metrics)

    def train_end(self, model: torch.nn.Module, reason: str) -> None:
        if self._train_end is not None:
            self._train_end(model, self.ctx, reason)

    # -- state: per rank, in the checkpoint ----------------------------------------------

    def state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (``{"task": ...}``), or nothing without state."""
        if self._state_dict is None:
            return {}
        return {"task": saveable(self._state_dict(), "state_dict()")}

    def restore(
        self, saved: list[Any] | None, world_size: int, warn: Callable[[str], None]
    ) -> None:
        """Give the task its saved state: rank r gets rank r's.

        ``saved``: each saving rank's state (None: the checkpoint holds no task state).
        Resumed on another world size, a rank the checkpoint has a state for still gets it
        and a rank it has none for starts fresh; ``warn`` says so once (rank 0).
        """
        rank = self.ctx.rank
        if saved is None:
            if self._load_state_dict is not None:
                warn("the checkpoint holds no task state: load_state_dict() not called")
            return
        if self._load_state_dict is None:
            warn("the checkpoint holds task state, but the task has no load_state_dict()")
            return
        if len(saved) != world_size:
            warn(
                f"task state saved by {len(saved)} ranks, resumed on {world_size}: rank r gets "
                f"rank r's state, ranks {len(saved)} and up start without"
            )
        if rank < len(saved):
            # Copies: the loaded tensors are the checkpoint file's mapping, which a later
            # prune deletes.
            self._load_state_dict(_to_cpu(saved[rank], clone=True))


# What torch.load(weights_only=True) reads back without help (besides tensors and the
# containers saveable walks): anything else is tried once per type (_loads_back).
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)
_tried: dict[type, bool] = {}


def saveable(obj: Any, where: str) -> Any:
    """The task's state as a checkpoint can hold it and a resume read it back.

    On the CPU (``_to_cpu``'s reason); a numpy number becomes the Python number it holds
    (``np.float64`` -> ``float``), since ``torch.load(weights_only=True)`` refuses numpy's
    types and the checkpoint would fail only at the resume, perhaps days later. Anything else
    a resume could not read fails this checkpoint, naming where in the state it is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: saveable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [saveable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(saveable(v, f"{where}[{i}]") for i, v in enumerate(obj))
    number = _numpy_number(obj)
    if number is not None:
        return number
    if isinstance(obj, _PLAIN) or _loads_back(obj):
        return obj
    module = type(obj).__module__
    kind = type(obj).__qualname__ if module == "builtins" else f"{module}.{type(obj).__qualname__}"
    hint = " (torch.from_numpy(a) or a.tolist())" if isinstance(obj, np.ndarray) else ""
    raise TypeError(
        f"the task's {where} ({kind}) is not what a resume can read back "
        f"(torch.load(weights_only=True)): keep to tensors{hint}, numbers, strings, "
        "lists and dicts"
    )


def _numpy_number(obj: Any) -> Any:
    """A numpy scalar's (or 0-d array's) Python value; None for anything else."""
    if isinstance(obj, np.generic) or (isinstance(obj, np.ndarray) and obj.ndim == 0):
        return obj.item()
    return None


def _loads_back(obj: Any) -> bool:
    kind = type(obj)
    if kind not in _tried:
        buffer = io.BytesIO()
        try:
            torch.save(obj, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
            _tried[kind] = True
        except Exception:
            _tried[kind] = False
    return _tried[kind]


def _to_cpu(obj: Any, clone: bool = False) -> Any:
    """Saved state is gathered to rank 0 by pickling: a CUDA tensor would land on rank 0's
    process on its own device. ``clone``: copies even of CPU tensors."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return t.clone() if clone and t.data_ptr() == obj.data_ptr() else t
    if isinstance(obj, dict):
        return {k: _to_cpu(v, clone) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v, clone) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v, clone) for v in obj)
    return obj


def added_figures(got: Any, metrics: dict[str, float]) -> dict[str, float]:
    """``on_eval_end``'s return value checked: None, or names (new ones) to numbers."""
    if got is None:
        return {}
    if not isinstance(got, dict):
        raise TypeError(
            f"on_eval_end must return None or a dict of names to numbers (got {type(got).__name__})"
        )
    out: dict[str, float] = {}
    for name, value in got.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"on_eval_end returned a figure named {name!r}: names are strings")
        if name in metrics:
            raise ValueError(f"on_eval_end returned {name!r}, a metric the eval reported already")
        try:
            out[name] = float(value)  # a number or a one-element tensor
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"on_eval_end returned {name!r} = {value!r}: not a number") from None
    return out
