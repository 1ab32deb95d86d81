"""The Task protocol: what a model, its data and its loss must provide to the engine.

A task is a class with a ``Config`` dataclass (its own ``[task]`` keys, declared with
:func:`gpu_console.schema.opt` or plain defaults) and three methods. The engine calls them
on every rank; the datasets must be the same on every rank (the engine shards them).

    class MyTask:
        Config = MyConfig

        def __init__(self, config: MyConfig): ...
        def build_model(self) -> torch.nn.Module: ...
        def build_datasets(self) -> tuple[Dataset, Dataset | None]: ...   # train, eval
        def compute(self, model, batch) -> TaskOutput: ...

``compute`` receives a batch already on the rank's device and returns the mean loss of the
batch, how many samples (and tokens, if any) it held, and optional metrics (batch means,
e.g. accuracy) that eval averages over the whole eval set.

The ``model`` ``compute`` gets: in training the DDP wrapper (call ``model(x)``: DDP's forward
is what averages the gradients in backward), in eval (and the FLOPs measurement) the bare
model: eval does not go through DDP, as ranks may hold different numbers of eval batches and
DDP's forward may broadcast buffers. ``train_step``, the hooks and ``configure_optimizers``
get the bare model. :func:`unwrap` reaches the model's own attributes in every case.

Optional hooks (the engine looks them up; a task without them works the same):

        def flops_per_sample(self) -> float: ...   # training FLOPs of one sample, for MFU
        def close(self) -> None: ...               # teardown: every rank, however it ended
        def export_modules(self) -> dict[str, str]: ...  # `gpu-console export`: {name: submodule}
        def configure_optimizers(self, model, ctx): ...  # own optimizers and schedules
        def train_step(self, model, batch, optimizers, ctx) -> TaskOutput: ...  # own updates
        def collate(self, batch): ...              # the fetched batch -> what compute gets
        resume_keys = {"data_dir": "accept"}       # --resume with a changed [task] key:
                                                   # "accept", "refuse" or (verdict, why)

``collate`` (engine/data.py ``collate_of``): the DataLoader fetches a batch at once, through
the dataset's ``__getitems__(indices)`` if it has one, else ``[dataset[i] for i in indices]``,
and passes that to the task's ``collate``; without one to ``default_collate``, except a
:class:`TensorSet`'s, already stacked and passed on as is. A dataset whose ``__getitems__``
returns a ready batch needs a ``collate`` (``return batch``). With workers it runs in them.
The training order is the profile's ``data.order`` (engine/data.py, docs/tasks.md: Data order).

``train_step`` (engine/task_step.py): the task's own backward/step sequence per micro-batch,
through ``optimizers.backward(loss, name)`` and ``optimizers.step(name)``.

Train metrics: ``TaskOutput.metrics`` returned at training steps (by ``compute`` or
``train_step``) go into step events' ``metrics``, reduced as the optional ``metric_reduce``
(a dict or a method: name → ``"mean_samples"`` (default), ``"mean_tokens"``, ``"sum"``,
``"max"``, ``"rank0"``) says (engine/train_metrics.py).

``configure_optimizers``: one ``torch.optim`` optimizer, an :class:`OptimizerSpec` (an
optimizer with its schedule), or a dict of them by name; it replaces the profile's
``train.optimizer`` and schedule (docs/tasks.md).

``flops_per_sample``: forward and backward (about 3× the forward), 2 FLOPs per multiply-add,
as :class:`torch.utils.flop_counter.FlopCounterMode` counts them (matmuls, convolutions,
attention). Without it the engine measures one batch with that counter before training.

``close``: on every rank once training has ended (finished, stopped or failed; after a
failure other ranks may be gone, so no collectives). Its exception is reported as a warning,
not as the run's outcome. The process's atexit handlers run after it, before the rank exits.

The context (:class:`gpu_console.engine.context.TaskContext`): the engine assigns
``task.ctx`` on every rank before it calls ``build_model`` (not yet in ``__init__``), and
passes the same object to the hooks below as their ``ctx``. It holds ``rank``,
``world_size``, ``local_rank``, ``device``, ``step``, ``epoch`` (kept current), ``run_dir``,
``task_dir`` (the task's own files), ``profile`` (the resolved, typed profile), ``resumed``,
``start_step``, and ``log(message, level="info")`` (a ``log`` event: the console's log pane
and the headless output; another rank's lines are prefixed ``rank N:`` and go to its own
output).

Optional hooks, each called on every rank at the same point (collectives are allowed), with
the bare model (no DDP wrapper) (engine/hooks.py):

        def on_step_end(self, model, output, ctx) -> None: ...      # after each optimizer step
        def on_epoch_end(self, model, ctx) -> None: ...             # the train data's epoch ended
        def on_eval_end(self, model, metrics, ctx) -> None: ...     # the reduced eval metrics
        def on_train_end(self, model, ctx, reason) -> None: ...     # finished, stopped, signal

``on_train_end`` runs once, after the end or stop checkpoint, before the final status; not
after a failure (``close`` does).

Optional state, saved per rank with every checkpoint and given back to the same rank on
resume (after ``build_model``/``build_datasets``, before the first step; tensors on the CPU;
what ``torch.load(weights_only=True)`` reads). Resumed on another world size, rank r gets
rank r's state where the checkpoint has one, else none, and the run warns:

        def state_dict(self) -> dict: ...
        def load_state_dict(self, state: dict) -> None: ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from ..engine.context import TaskContext
    from ..engine.task_step import StepOptimizers


@dataclass
class TaskOutput:
    loss: torch.Tensor
    samples: int
    tokens: int = 0
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under the engine's wrappers: DDP's (``.module``) and ``torch.compile``'s
    (``_orig_mod``), in any order and any number deep. ``compute`` gets the DDP wrapper in
    training: call ``model(x)`` there (its backward averages the gradients over the ranks) and
    reach the model's own attributes and submodules through ``unwrap(model).encoder``."""
    import torch

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            # torch.compile's wrapper (torch._dynamo.eval_frame); stubs: a tensor or module
            model = cast(torch.nn.Module, model._orig_mod)
        else:
            return model


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if autocast made it half precision (a loss wants fp32's range), else
    as it is: float32, or float64 under ``train.precision = "fp64"`` (never rounded down)."""
    import torch

    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def perplexity(metrics: dict[str, float]) -> float:
    """``exp(loss)`` of the averaged eval loss (inf where it overflows): for a task's
    ``derived_metrics = {"perplexity": perplexity}``."""
    loss = metrics["loss"]
    return math.exp(loss) if loss < 709.0 else math.inf


class Task(Protocol):
    """What every task provides (a task with ``train_step`` and no eval data may leave
    ``compute`` out: the loader checks for one or the other). The engine assigns ``ctx``
    before ``build_model``; a task that reads it declares ``ctx: TaskContext``. The optional
    hooks are the protocols below: a task has any of them, or none."""

    Config: type

    def __init__(self, config: Any) -> None: ...

    def build_model(self) -> torch.nn.Module: ...

    def build_datasets(self) -> tuple[Dataset, Dataset | dict[str, Dataset] | None]: ...

    def compute(self, model: torch.nn.Module, batch: Any) -> TaskOutput: ...


# -- the optional hooks, one protocol each: the engine looks each up on the task -------------


class StepsItself(Protocol):
    def train_step(
        self, model: torch.nn.Module, batch: Any, optimizers: StepOptimizers, ctx: TaskContext
    ) -> TaskOutput: ...


class ConfiguresOptimizers(Protocol):
    def configure_optimizers(self, model: torch.nn.Module, ctx: TaskContext) -> Optimizers: ...


class ParamGroups(Protocol):
    """The profile's optimizer over groups of the task's own: each a dict with ``params``."""

    def param_groups(self, model: torch.nn.Module) -> list[dict[str, Any]]: ...


class ExpertParameters(Protocol):
    """Names of the parameters each rank holds alone (the ``expert`` strategy)."""

    def expert_parameters(self, model: torch.nn.Module) -> list[str]: ...


class CountsFlops(Protocol):
    def flops_per_sample(self) -> float: ...


class Closes(Protocol):
    def close(self) -> None: ...


class ExportsModules(Protocol):
    def export_modules(self) -> dict[str, str]: ...


class Collates(Protocol):
    def collate(self, batch: Any) -> Any: ...


class NamesBlocks(Protocol):
    """Activation checkpointing and FSDP's units: the model's repeated blocks."""

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]: ...


class HasState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class OnStepEnd(Protocol):
    def on_step_end(self, model: torch.nn.Module, output: TaskOutput, ctx: TaskContext) -> None: ...


class OnEpochEnd(Protocol):
    def on_epoch_end(self, model: torch.nn.Module, ctx: TaskContext) -> None: ...


class OnEvalStart(Protocol):
    def on_eval_start(self, model: torch.nn.Module, ctx: TaskContext) -> None: ...


class OnEvalEnd(Protocol):
    """It may return figures of its own, added to the eval event (engine/hooks.py)."""

    def on_eval_end(
        self, model: torch.nn.Module, metrics: dict[str, float], ctx: TaskContext
    ) -> dict[str, float] | None: ...


class OnTrainEnd(Protocol):
    def on_train_end(self, model: torch.nn.Module, ctx: TaskContext, reason: str) -> None: ...


# -- optimizers: the optional hook configure_optimizers(model, ctx) --------------------------


@dataclass
class OptimizerSpec:
    """One optimizer a task's ``configure_optimizers(model, ctx)`` builds, and its schedule.

    ``schedule`` is one of:

    - ``None``: the lr stays what the optimizer's groups say;
    - a function ``f(step) -> factor`` of the completed steps, multiplying each group's lr
      before the update that follows (as ``torch.optim.lr_scheduler.LambdaLR``, which wraps it);
    - a ``torch.optim.lr_scheduler.LRScheduler`` over this optimizer, stepped after every
      update;
    - a ``ReduceLROnPlateau``, stepped after every eval with the eval metric ``monitor``
      names (a key of the eval event: ``"loss"`` or one of ``compute``'s metrics).
    """

    optimizer: torch.optim.Optimizer
    schedule: Any = None
    monitor: str | None = None


# What configure_optimizers may return: one optimizer (named "main"), one OptimizerSpec, or
# a dict of them by name (the names checkpoints, the start event and step events use).
# A string: torch is imported for type checking only (this module stays torch-free).
Optimizers: TypeAlias = (
    "torch.optim.Optimizer | OptimizerSpec | dict[str, torch.optim.Optimizer | OptimizerSpec]"
)


class TensorSet:
    """A map-style dataset over equal-length tensors with batched indexing.

    ``__getitems__`` lets the DataLoader fetch a whole batch with one index operation
    instead of collating per-sample tensors, which dominates small models' step time.
    """

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        import torch

        idx = torch.as_tensor(indices)
        return tuple(t[idx] for t in self.tensors)


def batch_collate(batch: Any) -> Any:
    """The collate function for :class:`TensorSet`: the batch is already stacked."""
    return batch
