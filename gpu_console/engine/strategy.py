"""The parallel strategy: how the model is spread over the ranks, as one interface.

The trainer never asks which strategy it runs: it calls these methods, and a strategy is a
class that answers them (``distributed.strategy`` picks it, :func:`for_profile`). Today three:

- ``ddp`` (strategy_ddp.py): every rank holds the whole model; DDP all-reduces gradients,
  and a log step's table rides the gradient all-reduce through a communication hook;
  checkpoints are plain files of the whole state, written by rank 0 (in the background).
- ``fsdp`` (strategy_fsdp.py): FSDP2 shards parameters, gradients and optimizer state;
  mixed precision is FSDP's (no autocast); the log table takes a collective of its own;
  every rank writes its shards through ``torch.distributed.checkpoint``.
- ``single`` (strategy_single.py): ``ddp`` on one rank, without the DDP wrapper.
- ``expert`` (strategy_expert.py): ``ddp`` for the replicated parameters, each rank alone
  with its experts (a task's ``expert_parameters``), checkpoints of the whole model.

A new strategy is a new class here, not branches in the trainer: see ARCHITECTURE.md,
"Where new pieces go".
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..profile import DistributedConfig
    from ..tasks.base import Task
    from .checkpoint import Resumed
    from .checkpoint_writer import Writer
    from .distributed import Dist
    from .exchange import Exchange
    from .optim_set import Optimizers
    from .shared_reduce import SharedReduce

# What a checkpoint saves and loads of the GradScalers: one, one per optimizer (a task's
# own step, by name), or None (update_step.py).
Scalers: TypeAlias = torch.amp.GradScaler | dict[str, torch.amp.GradScaler] | None


@dataclass
class SaveJob:
    """One checkpoint to write, with what every strategy's writer may need."""

    run_dir: Path
    step: int
    reason: str
    state: dict[str, Any]  # the shared state (model, optimizers, step, data, ...)
    rank_state: dict[str, Any]  # this rank's own (RNG, task state)
    best: dict[str, Any] | None  # the best eval so far, kept beside the checkpoint
    requested: float  # perf_counter when the save was asked for
    waited: float  # seconds spent waiting for the write before it
    model: nn.Module
    optimizers: Optimizers
    writer: Writer
    group: dist.ProcessGroup  # the checkpoint writes'
    keep_last: int
    is_main: bool


class TaskStepRules:
    """How a task's own ``train_step`` (task_step.py) makes, averages and clips one
    optimizer's gradients. These are one rank's rules (nothing to reduce): what a task's step
    rehearsed alone gets (plan.py, auto_batch.py); every strategy refines them."""

    def task_backward(self, loss: torch.Tensor, params: list, others: list) -> None:
        """The gradients of ``loss`` for ``params`` (one optimizer's) only; ``others``: the
        other optimizers' parameters, whose gradients must stay as they were."""
        loss.backward(inputs=params)

    def average_grads(self, params: list) -> None:
        """``params``' gradients replaced by what the engine's own step would hand their
        optimizer: their mean over the ranks, by this strategy's rule."""

    def clip_grads(self, params: list, max_norm: float) -> torch.Tensor:
        """Clip averaged gradients of ``params`` to ``max_norm``: their norm over the whole
        model (the same on every rank)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class Strategy(TaskStepRules, ABC):
    """The interface. The abstract methods are what every strategy provides; each other
    method's default is what a strategy that does nothing there does."""

    name = ""
    # Why a closure optimizer (LBFGS) cannot train under this strategy, as (key, one line),
    # or None where it can (closure_step.py).
    closure_refusal: tuple[str, str] | None = None
    # What the trainer trains: called, train()/eval(), ``.module`` the bare model, no_sync().
    wrapped: Any = None

    @abstractmethod
    def make_scaler(
        self, precision: str, device_type: str, init_scale: float
    ) -> torch.amp.GradScaler | None:
        """The GradScaler (fp16 on a GPU) starting at ``init_scale``, or None."""
        raise NotImplementedError

    def load_before_wrap(
        self, point: Path, model: nn.Module, optimizers: Optimizers, scalers: Scalers, d: Dist
    ) -> Resumed | None:
        """A checkpoint loaded into the bare model (a ``checkpoint.Resumed``), or None when
        this strategy loads after wrapping."""
        return None

    @abstractmethod
    def wrap(
        self,
        model: nn.Module,
        task: Task,
        precision: str,
        optimizers: Optimizers,
        warn: Callable[[str], None],
    ) -> None:
        """Spread the model over the ranks; sets :attr:`wrapped`."""
        raise NotImplementedError

    def load_after_wrap(
        self, point: Path, model: nn.Module, optimizers: Optimizers, scalers: Scalers, d: Dist
    ) -> Resumed | None:
        """A checkpoint loaded into the wrapped model, or None (loaded before, or not here)."""
        return None

    def autocast(
        self, autocast: contextlib.AbstractContextManager
    ) -> contextlib.AbstractContextManager:
        """The autocast the step runs under, given the precision's."""
        return autocast

    @property
    def compute_model(self) -> Any:
        """What a task's ``compute`` is handed."""
        return self.wrapped

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A micro-batch that is not the step's last: gradients accumulate, unreduced."""
        return self.wrapped.no_sync()

    @abstractmethod
    def clip(
        self, optimizers: Optimizers, max_norm: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clip every optimizer's gradients: the norm over all, and each one's."""
        raise NotImplementedError

    @abstractmethod
    def gradient_reduce(
        self, d: Dist, cfg: DistributedConfig, run_dir: Path
    ) -> tuple[SharedReduce | None, str | None]:
        """How gradients are summed: a ``SharedReduce`` (or None), and why not one."""
        raise NotImplementedError

    def carry_table(self, exchange: Exchange) -> None:
        """Let a log step's table ride the gradient reduction; by default it does not (then
        ``Exchange.gather`` makes a collective of its own)."""
        return None  # a default, not abstract: DDP's hook is the only one so far

    @abstractmethod
    def save(self, job: SaveJob) -> dict[str, Any] | None:
        """Write a checkpoint: its outcome, or None while a background write is in flight."""
        raise NotImplementedError

    @abstractmethod
    def start_fields(self) -> dict[str, Any]:
        """The start event's ``ddp`` and ``fsdp`` fields (the other one None)."""
        raise NotImplementedError


def choose(
    cfg: DistributedConfig,
    world_size: int,
    task: Task | object | None = None,
    model: nn.Module | None = None,
) -> tuple[str, list[str]]:
    """The one choice of a strategy (its class's ``name``) and the task's rank-local expert
    parameters: what ``distributed.strategy`` names (``ddp`` on one rank: ``single``); a task
    that names rank-local expert parameters on several ranks: ``expert``. The ranks
    (:func:`for_profile`) and ``--dry-run`` (plan.py) both ask it, so they cannot disagree."""
    from .strategy_expert import ExpertParallelError, expert_names

    names = expert_names(task, model) if task is not None and world_size > 1 else []
    if names:
        if cfg.strategy == "fsdp":
            raise ExpertParallelError(
                'task.expert_parallel: not with distributed.strategy = "fsdp" (experts are '
                "spread over the ranks, the rest replicated under DDP)"
            )
        return "expert", names
    if cfg.strategy == "fsdp":
        return "fsdp", []
    return ("single" if world_size == 1 else "ddp"), []


def class_of(name: str) -> type[Strategy]:
    """The class of the strategy :func:`choose` names: what the console side asks about a
    strategy (``--dry-run``, plan.py) without making one."""
    if name == "expert":
        from .strategy_expert import ExpertParallelStrategy

        return ExpertParallelStrategy
    if name == "fsdp":
        from .strategy_fsdp import FsdpStrategy

        return FsdpStrategy
    if name == "single":
        from .strategy_single import SingleStrategy

        return SingleStrategy
    from .strategy_ddp import DdpStrategy

    return DdpStrategy


def closure_refused(name: str, optimizers: Optimizers) -> tuple[str, str] | None:
    """(key, why) when one of the optimizers steps with a closure (LBFGS) and the strategy
    cannot train it (:attr:`Strategy.closure_refusal`); None otherwise."""
    from .closure_step import needs_closure

    why = class_of(name).closure_refusal
    if why and any(needs_closure(e.optimizer) for e in optimizers.entries):
        return why
    return None


def for_profile(
    cfg: DistributedConfig, d: Dist, task: Task | None = None, model: nn.Module | None = None
) -> Strategy:
    """The strategy :func:`choose` picks, made for rank ``d``."""
    name, experts = choose(cfg, d.world_size, task, model)
    if name == "expert":
        from .strategy_expert import ExpertParallelStrategy

        assert model is not None  # expert parameters are named from it
        return ExpertParallelStrategy(cfg, d, model, experts)
    return class_of(name)(cfg, d)  # type: ignore[call-arg]  # each takes (cfg, d)
