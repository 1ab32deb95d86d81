"""The run's optimizers by name: the profile's one, or those a task's hook builds.

A task with ``configure_optimizers(model, ctx)`` owns its optimizers and their schedules
(tasks/base.py: :class:`OptimizerSpec`); without it, the profile's ``train.optimizer`` with
its groups (optim_build.py) and its schedule (schedule.py) is the one optimizer, ``main``.
Around each optimizer the engine still does the same work, in a fixed order each step:
(fp16) unscale, clip its own parameters to ``train.clip_grad_norm``, the ``nan_policy``
check, step (through the GradScaler under fp16), step its schedule, ``zero_grad``.

Resume: every optimizer's and schedule's state comes back from the checkpoint. The
profile's optimizer and every function schedule the engine wraps (``LambdaLR``) then take
this run's settings over the restored state (resume.py: ``--set train.lr`` applies); a
task's own torch schedulers (a ``ReduceLROnPlateau`` keeps its reductions in the groups'
lr) keep exactly what was saved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from ..devices import FUSED_UNDER_SHARDED_SCALER
from ..tasks.base import OptimizerSpec
from . import optim_build as optim
from .resume import Settings
from .schedule import decay_steps, floor_ratio, lr_factor, scaled_lr
from .step_watch import StepWatch

MAIN = "main"  # the name of a single optimizer


class OptimizerSetupError(ValueError):
    """A ``configure_optimizers`` result the engine cannot run; the message says why."""


@dataclass
class Entry:
    name: str
    optimizer: torch.optim.Optimizer
    scheduler: Any  # LambdaLR, another LRScheduler, ReduceLROnPlateau, or None
    schedule: dict[str, Any]  # what the start event says about it
    monitor: str | None
    params: list[torch.Tensor]  # what clipping covers, in a fixed order
    own_settings: bool  # this run's settings go over the restored state (resume.py)

    @property
    def per_step(self) -> bool:
        return self.scheduler is not None and not isinstance(self.scheduler, ReduceLROnPlateau)


class Optimizers:
    """The run's optimizers, in the order the task named them (the first is the step
    event's ``lr``)."""

    def __init__(self, entries: list[Entry], source: str, decay: optim.DecaySplit | None):
        self.entries = entries
        self.source = source  # "profile" or "task"
        self.decay = decay
        self.watch = StepWatch()  # a step the engine does not make: refused on several ranks

    # -- building ---------------------------------------------------------------------
    @classmethod
    def build(
        cls, task, model, p, world_size: int, device_type: str, ctx, fused_ok: bool = True
    ) -> Optimizers:
        """``fused_ok``: whether a fused kernel can step under the run's GradScaler
        (devices.fused_steps_ok); where not, ``auto`` picks foreach and a fused optimizer
        asked for by name is refused before the first step, with why."""
        hook = getattr(task, "configure_optimizers", None)
        if hook is None:
            return cls.from_profile(task, model, p, world_size, device_type, fused_ok)
        opts = cls.from_task(hook(model, ctx), model)
        fused = [e.name for e in opts.entries if e.optimizer.defaults.get("fused")]
        if fused and not fused_ok:
            raise OptimizerSetupError(
                f"task.configure_optimizers: optimizer {fused[0]!r} is fused, and "
                f"{FUSED_UNDER_SHARDED_SCALER}: build it with foreach=True"
            )
        return opts

    @classmethod
    def from_profile(
        cls, task, model, p, world_size: int, device_type: str, fused_ok: bool = True
    ) -> Optimizers:
        t = p.train
        if t.optimizer_impl == "fused" and not fused_ok:
            raise OptimizerSetupError(
                f"train.optimizer_impl: {FUSED_UNDER_SHARDED_SCALER}; use auto (foreach "
                "there) or foreach (got 'fused')"
            )

        def scale(x: float) -> float:
            return scaled_lr(x, world_size, p.distributed.lr_scaling)

        groups, decay = optim.groups(task, model, t, scale)
        opt = optim.build_profile(groups, scale(t.lr), t, device_type, fused_ok)
        scheduler = LambdaLR(opt, lambda s: lr_factor(s, t))
        schedule = {
            "kind": t.schedule,
            "warmup_steps": t.warmup_steps,
            "decay_steps": decay_steps(t),
            "floor": floor_ratio(t),
        }
        params = [q for q in model.parameters() if q.requires_grad]
        entry = Entry(MAIN, opt, scheduler, schedule, None, params, True)
        return cls([entry], "profile", decay)

    @classmethod
    def from_task(cls, returned: Any, model: torch.nn.Module) -> Optimizers:
        named = returned if isinstance(returned, dict) else {MAIN: returned}
        if not named:
            raise OptimizerSetupError("task.configure_optimizers: returned no optimizer")
        entries = [_entry(str(name), spec) for name, spec in named.items()]
        _check_coverage(entries, model)
        # Clipped in the model's parameter order, as a script's clip_grad_norm_(model
        # .parameters()) clips: the total norm's sum is then the same to the last bit.
        order = {id(q): i for i, q in enumerate(model.parameters())}
        for e in entries:
            e.params.sort(key=lambda q: order.get(id(q), len(order)))
        return cls(entries, "task", None)

    @classmethod
    def single(cls, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None) -> Optimizers:
        """One optimizer and its ``LambdaLR`` (tools and tests that build their own)."""
        params = [q for g in optimizer.param_groups for q in g["params"]]
        entry = Entry(MAIN, optimizer, scheduler, {"kind": "function"}, None, params, True)
        return cls([entry], "profile", None)

    # -- each step ------------------------------------------------------------------------
    @property
    def first(self) -> torch.optim.Optimizer:
        return self.entries[0].optimizer

    def unscale(self, scaler: torch.amp.GradScaler) -> None:
        for e in self.entries:
            scaler.unscale_(e.optimizer)

    def clip(self, max_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clip each optimizer's gradients on their own; the norm over all, and each's."""
        norms = {e.name: torch.nn.utils.clip_grad_norm_(e.params, max_norm) for e in self.entries}
        if len(norms) == 1:
            return next(iter(norms.values())), norms
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
        return total, norms

    def step(self, scaler: torch.amp.GradScaler | None) -> None:
        for e in self.entries:
            with self.watch.engine(e.optimizer):
                if scaler is not None:
                    scaler.step(e.optimizer)
                else:
                    e.optimizer.step()
        if scaler is not None:
            scaler.update()

    def schedule(self) -> None:
        for e in self.entries:
            if e.per_step:
                e.scheduler.step()

    def zero_grad(self) -> None:
        for e in self.entries:
            e.optimizer.zero_grad(set_to_none=True)

    def after_eval(self, metrics: dict[str, float]) -> None:
        """Step the metric-driven schedules with the eval's metrics (the same on every rank)."""
        for e in self.entries:
            if isinstance(e.scheduler, ReduceLROnPlateau):
                if e.monitor not in metrics:
                    known = ", ".join(sorted(metrics)) or "none"
                    raise OptimizerSetupError(
                        f"task.configure_optimizers: optimizer {e.name!r}: monitor "
                        f"{e.monitor!r} is not an eval metric (the eval gave: {known})"
                    )
                e.scheduler.step(metrics[e.monitor])

    def lrs(self) -> dict[str, float]:
        """Each optimizer's lr (its first group's) for the update that follows."""
        return {e.name: float(e.optimizer.param_groups[0]["lr"]) for e in self.entries}

    def rewindable(self) -> bool:
        return all(e.scheduler is None or isinstance(e.scheduler, LambdaLR) for e in self.entries)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``optimizers`` and ``schedulers`` by name. ``optimizer`` and ``scheduler`` are the
        first one's again (the same objects: stored once), the layout before several."""
        opts = {e.name: e.optimizer.state_dict() for e in self.entries}
        scheds = {e.name: e.scheduler.state_dict() for e in self.entries if e.scheduler is not None}
        first = self.entries[0].name
        return {
            "optimizers": opts,
            "schedulers": scheds,
            "optimizer": opts[first],
            "scheduler": scheds.get(first),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's states; one written before several optimizers has one, ``main``."""
        if "optimizers" in state:
            opts, scheds = state["optimizers"], state.get("schedulers") or {}
        else:
            opts, scheds = {MAIN: state["optimizer"]}, {MAIN: state.get("scheduler")}
        ours = [e.name for e in self.entries]
        if sorted(opts) != sorted(ours):
            raise optim.ParamGroupError(
                f"the checkpoint holds optimizers {sorted(opts)}, this run builds {sorted(ours)}"
            )
        for e in self.entries:
            settings = Settings.of(e.optimizer, e.scheduler) if e.own_settings else None
            optim.load_state(e.optimizer, opts[e.name])  # or why its groups do not fit
            if e.scheduler is not None and scheds.get(e.name) is not None:
                e.scheduler.load_state_dict(scheds[e.name])
            if settings is not None:
                settings.restore(e.optimizer, e.scheduler)

    # -- what was built ---------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Per optimizer: name, class, kernel, param groups and schedule (start event, plan)."""
        out = []
        for e in self.entries:
            groups = []
            for i, g in enumerate(e.optimizer.param_groups):
                peak = e.scheduler.base_lrs[i] if isinstance(e.scheduler, LambdaLR) else g["lr"]
                groups.append(
                    {
                        "tensors": len(g["params"]),
                        "params": sum(q.numel() for q in g["params"]),
                        "lr": float(peak),
                        "weight_decay": float(g.get("weight_decay", 0.0)),
                    }
                )
            out.append(
                {
                    "name": e.name,
                    "class": type(e.optimizer).__name__,
                    "impl": optim.implementation(e.optimizer),
                    "param_groups": groups,
                    "schedule": e.schedule,
                }
            )
        return out

    def summary(self) -> str:
        """``AdamW (fused)``; several: ``d: Adam (foreach), g: Adam (foreach)``."""
        one = [f"{type(e.optimizer).__name__} ({optim.implementation(e.optimizer)})"
               for e in self.entries]  # fmt: skip
        if self.source == "profile" or len(one) == 1 and self.entries[0].name == MAIN:
            return one[0]
        return ", ".join(f"{e.name}: {s}" for e, s in zip(self.entries, one, strict=True))


def _entry(name: str, spec: Any) -> Entry:
    where = f"task.configure_optimizers: optimizer {name!r}"
    if isinstance(spec, torch.optim.Optimizer):
        spec = OptimizerSpec(spec)
    if not isinstance(spec, OptimizerSpec) or not isinstance(spec.optimizer, torch.optim.Optimizer):
        raise OptimizerSetupError(
            f"{where}: expected a torch.optim optimizer or an OptimizerSpec (got {spec!r:.80})"
        )
    opt, schedule = spec.optimizer, spec.schedule
    own = False
    scheduler: LRScheduler | ReduceLROnPlateau | None
    if schedule is None:
        scheduler, kind = None, {"kind": "none"}
    elif isinstance(schedule, ReduceLROnPlateau):
        if not spec.monitor:
            raise OptimizerSetupError(
                f"{where}: a ReduceLROnPlateau needs monitor, the eval metric it steps with"
            )
        scheduler, kind = schedule, {"kind": "ReduceLROnPlateau", "monitor": spec.monitor}
    elif isinstance(schedule, LRScheduler):
        scheduler, kind = schedule, {"kind": type(schedule).__name__}
    elif callable(schedule):
        scheduler, kind, own = LambdaLR(opt, _factor(schedule)), {"kind": "function"}, True
    else:
        raise OptimizerSetupError(
            f"{where}: schedule must be a function of the step, a torch LRScheduler or a "
            f"ReduceLROnPlateau (got {schedule!r:.80})"
        )
    if scheduler is not None and scheduler.optimizer is not opt:
        raise OptimizerSetupError(f"{where}: its schedule was built over another optimizer")
    params = [q for g in opt.param_groups for q in g["params"]]
    return Entry(name, opt, scheduler, kind, spec.monitor, params, own)


def _factor(fn: Callable[[int], float]) -> Callable[[int], float]:
    def factor(step: int) -> float:
        value = float(fn(step))
        if not math.isfinite(value) or value < 0:
            raise OptimizerSetupError(
                f"task.configure_optimizers: the schedule gave lr factor {value} at step {step}"
            )
        return value

    return factor


def _check_coverage(entries: list[Entry], model: torch.nn.Module) -> None:
    """Every trainable parameter in exactly one optimizer: no update twice, none forgotten."""
    names = {id(q): n for n, q in model.named_parameters()}
    owner: dict[int, str] = {}
    for e in entries:
        for q in e.params:
            if id(q) in owner and owner[id(q)] != e.name:
                raise OptimizerSetupError(
                    f"task.configure_optimizers: parameter {names.get(id(q), '?')!r} is in "
                    f"optimizers {owner[id(q)]!r} and {e.name!r}"
                )
            owner[id(q)] = e.name
    missing = [n for n, q in model.named_parameters() if q.requires_grad and id(q) not in owner]
    if missing:
        raise OptimizerSetupError(
            f"task.configure_optimizers: {len(missing)} trainable parameters are in no "
            f"optimizer (first: {missing[0]!r}); set requires_grad = False on those it freezes"
        )
