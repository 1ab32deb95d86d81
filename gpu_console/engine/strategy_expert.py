"""Expert parallelism: DDP for the replicated parameters, each rank alone with its experts.

Chosen for a run on several ranks whose task names rank-local parameters in
``expert_parameters(model)`` (the built-in ``moe`` with its ``expert_parallel`` key on).
Each name is a parameter whose first dimension counts experts; rank r holds the r-th of
``world`` equal slices of the whole, and the task's forward sends every token to the rank of
its expert and back (``all_to_all``). What the engine does differently from DDP:

- **Gradients.** DDP ignores the expert parameters (torch_private.ddp_ignore). A rank's
  expert gradient already sums every rank's tokens (the exchange's backward brings them
  home), where DDP would average: a hook divides it by the world size, so an update equals
  the replicated run's. A task's own ``train_step`` gets the same rule: its
  ``optimizers.step`` averages the replicated parameters only (``average_grads``).
- **Clipping.** The norm over all parameters is the replicated run's: the experts' squared
  norms are summed over the ranks (one all-reduce of a few numbers), the rest are the same
  everywhere.
- **Checkpoints hold the whole model.** At a save every rank's experts (and their optimizer
  state) are gathered into the whole tensors, so the file is the replicated run's layout:
  ``export`` and a resume without expert parallelism read it as any other, and a resume on
  another world size takes its own slices (the experts must divide evenly over its ranks).
  Gathering costs a rank the whole expert state's memory for the moment of the save; for
  models where that does not fit, per-rank shards (DCP) are the way on.
- **Eval.** Every forward is a collective, so every rank runs as many eval forwards as the
  rank with the most (``same_forwards``, as under FSDP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, torch_private
from .strategy import SaveJob
from .strategy_ddp import DdpStrategy, settings


def _scale(params, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``params``' gradients scaled down to ``max_norm`` by their whole norm ``norm``."""
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm


class ExpertParallelError(ValueError):
    """A task's experts cannot be spread over this run's ranks."""


def expert_names(task, model) -> list[str]:
    """The task's rank-local parameter names (none: not an expert-parallel task)."""
    hook = getattr(task, "expert_parameters", None)
    return list(hook(model)) if callable(hook) else []


class ExpertParallelStrategy(DdpStrategy):
    name = "expert"
    # Found by the parity matrix: each rank's LBFGS would decide on its own experts alone
    # (two ranks differ from one from the second step).
    closure_refusal = (
        "task.expert_parameters",
        "a closure optimizer (LBFGS) needs every parameter's gradient for its decisions (its "
        "norms, directions and line search), and each rank holds its own experts: use an "
        "optimizer without a closure, or keep every expert on every rank (moe: "
        "set task.expert_parallel to false)",
    )

    def __init__(self, cfg, d, model, names: list[str]) -> None:
        super().__init__(cfg, d)
        params = dict(model.named_parameters())
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ExpertParallelError(
                f"task.expert_parameters: no such parameter: {', '.join(unknown[:3])}"
            )
        self.experts = {n: params[n] for n in names}
        self.ids = {id(p) for p in self.experts.values()}
        self.world, self.rank = d.world_size, d.rank

    # -- the model ---------------------------------------------------------------------------
    def wrap(self, model, task, precision_: str, optimizers, warn) -> None:
        torch_private.ddp_ignore(model, list(self.experts))
        super().wrap(model, task, precision_, optimizers, warn)
        self.wrapped.same_forwards = True  # evaluate.py: every forward is a collective
        for p in self.experts.values():
            p.register_hook(self._average)

    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.world

    def clip(self, optimizers, max_norm: float) -> tuple[Any, dict[str, Any]]:
        """Each optimizer's gradients clipped by their norm over every rank's experts."""
        entries = optimizers.entries
        local = [self._squares(e.params) for e in entries]  # (replicated, expert) each
        shared = torch.stack([ex for _, ex in local])
        dist.all_reduce(shared)
        norms = {}
        for e, (rep, _), ex in zip(entries, local, shared, strict=True):
            norms[e.name] = _scale(e.params, (rep + ex).sqrt(), max_norm)
        if len(norms) == 1:
            return next(iter(norms.values())), norms
        return torch.linalg.vector_norm(torch.stack(list(norms.values()))), norms

    # -- a task's own train_step: the same rules, one optimizer at a time ---------------------
    def average_grads(self, params: list) -> None:
        """The replicated parameters as DDP averages them; the experts are this rank's alone
        and their hook has already divided them (every backward runs it), as on the
        engine's own step."""
        super().average_grads([p for p in params if id(p) not in self.ids])

    def clip_grads(self, params: list, max_norm: float) -> torch.Tensor:
        rep, ex = self._squares(params)
        shared = ex.reshape(1)  # as clip's stack of one optimizer: the same sum
        dist.all_reduce(shared)
        return _scale(params, (rep + shared[0]).sqrt(), max_norm)

    def _squares(self, params) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared gradient norms of the replicated parameters and of this rank's experts."""
        device = self.d.device
        rep, ex = torch.zeros((), device=device), torch.zeros((), device=device)
        for p in params:
            if p.grad is not None:
                sq = p.grad.detach().float().pow(2).sum()
                if id(p) in self.ids:
                    ex = ex + sq
                else:
                    rep = rep + sq
        return rep, ex

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, job: SaveJob) -> dict[str, Any] | None:
        """Collective: the experts gathered into the whole (model and optimizer state)."""
        model = job.state["model"]
        for name in self.experts:
            model[name] = self._gather(model[name])
        for state, optimizer in self._optimizer_states(job.state, job.optimizers):
            for index in self._expert_indices(optimizer):
                per = state["state"].get(index)
                if per is not None:
                    state["state"][index] = {k: self._gather_like(v, index, optimizer)
                                             for k, v in per.items()}  # fmt: skip
        return super().save(job)

    def load_before_wrap(self, point: Path, model, optimizers, scalers, d) -> Any:
        """This rank's slices of the whole experts (any world size they divide evenly over)."""
        state = checkpoint.load(point)
        for name, p in self.experts.items():
            state["model"][name] = self._slice(state["model"][name], p, name)
        for saved, optimizer in self._optimizer_states(state, optimizers):
            for index in self._expert_indices(optimizer):
                per = saved["state"].get(index)
                p = self._param_at(optimizer, index)
                if per is not None:
                    saved["state"][index] = {k: self._slice(v, p, "optimizer state")
                                             for k, v in per.items()}  # fmt: skip
        return checkpoint.resume_state(state, model, optimizers, scalers, d.rank, d.world_size)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts)

    def _gather_like(self, value: Any, index: int, optimizer) -> Any:
        """An optimizer state entry shaped like its expert parameter, gathered; a scalar
        (Adam's step) is the same on every rank and stays as it is."""
        p = self._param_at(optimizer, index)
        if isinstance(value, torch.Tensor) and value.shape == p.shape and value.ndim:
            return self._gather(value)
        return value

    def _slice(self, value: Any, p: torch.Tensor, what: str) -> Any:
        """This rank's slice of a whole tensor (a scalar, Adam's step, stays as it is)."""
        if isinstance(value, torch.Tensor) and value.ndim:
            return self._own(value, p, what)
        return value

    def _own(self, whole: torch.Tensor, p: torch.Tensor, what: str) -> torch.Tensor:
        n = p.shape[0]
        if whole.shape[0] != n * self.world or whole.shape[1:] != p.shape[1:]:
            raise ExpertParallelError(
                f"{what}: the checkpoint holds {whole.shape[0]} experts of shape "
                f"{tuple(whole.shape[1:])}; {self.world} ranks of {n} need {n * self.world}"
            )
        return whole[self.rank * n : (self.rank + 1) * n]

    @staticmethod
    def _optimizer_states(state: dict[str, Any], optimizers) -> list[tuple[dict, Any]]:
        """Each optimizer's saved state beside the optimizer (the layout by name, or the one
        before several optimizers)."""
        opts = state.get("optimizers") or {optimizers.entries[0].name: state["optimizer"]}
        return [(opts[e.name], e.optimizer) for e in optimizers.entries if e.name in opts]

    def _expert_indices(self, optimizer) -> list[int]:
        """Where the experts sit in the optimizer's state dict (it numbers the parameters
        group by group, in order)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return [i for i, p in enumerate(params) if id(p) in self.ids]

    @staticmethod
    def _param_at(optimizer, index: int) -> torch.Tensor:
        return [p for g in optimizer.param_groups for p in g["params"]][index]

    def start_fields(self) -> dict[str, Any]:
        experts = sum(p.numel() for p in self.experts.values())
        return {
            "ddp": settings(self.wrapped),
            "fsdp": None,
            "expert_parallel": {"parameters": len(self.experts), "elements_per_rank": experts},
        }
