"""Resuming from a checkpoint with the settings of the profile the run resumes with.

``optimizer.load_state_dict`` brings back the saved param groups' settings (lr, weight
decay, betas, the kernel flags) and ``scheduler.load_state_dict`` the saved base lrs: a
``--resume RUN --set train.lr=0.5`` would go on at the old lr. What a resumed run takes
from the checkpoint is its state (weights, moments, step counts, the schedule's position);
its settings come from its profile, as built before the state was loaded. Which changes
a resume accepts is decided before launch (gpu_console/resume_changes.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runs import list_checkpoints, resume_checkpoint
from . import checkpoint, torch_private
from .data import DataPosition

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR

    from .checkpoint import Resumed
    from .distributed import Dist
    from .hooks import Hooks
    from .reporter import Reporter


@dataclass
class Settings:
    """The settings of a freshly built optimizer and schedule, to outlive a state load."""

    groups: list[dict[str, Any]]
    base_lrs: list[float | torch.Tensor]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> Settings:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(groups, list(scheduler.base_lrs))

    def restore(self, optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
        """Put the settings back over loaded state; the lr is the schedule's at its step.

        With unchanged settings this writes the very values the state held (the same
        floats, computed the same way), so an unchanged resume stays bit-exact.
        """
        if len(self.groups) != len(optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(optimizer.param_groups)} param groups, "
                f"this run's {len(self.groups)}"
            )
        for group, fresh in zip(optimizer.param_groups, self.groups, strict=True):
            group.update(fresh)
            if group.get("fused") or group.get("capturable"):
                # The kernel may have changed (train.optimizer_impl): these keep the step
                # count on the parameters' device, as load_state_dict would have put it.
                _steps_to_device(optimizer, group["params"])
        scheduler.base_lrs = list(self.base_lrs)
        step = scheduler.last_epoch
        pairs = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        lrs = [base * f(step) for base, f in pairs]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        # What get_last_lr() (the step events' lr) reads; the scheduler sets it the same way.
        torch_private.set_last_lr(scheduler, lrs)


def _steps_to_device(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    for q in params:
        state = optimizer.state.get(q) or {}
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != q.device:
            state["step"] = step.to(device=q.device, dtype=torch.float32)


def old_batch_size(changes: list[dict], batch_size: int) -> int:
    """The batch size the checkpoint was written with (the session's recorded change, if
    any): an old checkpoint counts its position in this rank's micro-batches of it."""
    for c in changes:
        if c.get("key") == "data.batch_size" and isinstance(c.get("old"), int):
            return c["old"]
    return batch_size


def data_position(state: dict, changes: list[dict], batch_size: int) -> DataPosition:
    """The checkpoint's data position in samples, whatever format it was written in."""
    world = int(state.get("world_size") or len(state.get("ranks") or []) or 1)
    return position_of(state["data"], world, changes, batch_size)


def position_of(data: dict, world: int, changes: list[dict], batch_size: int) -> DataPosition:
    """A saved position (``data``, written by ``world`` ranks) in samples."""
    return DataPosition.from_state(data, world, old_batch_size(changes, batch_size))


def resume_point(
    run_dir: Path, requested: Path | None, restart: int, d: Dist, out: Reporter
) -> Path | None:
    """Where to start from, decided by rank 0 and shared with every rank.

    After a restart by torchrun, the run's own newest complete checkpoint (else what the run
    was started from); otherwise ``--resume``'s. On several nodes the path is rank 0's: the
    other nodes must see it (a shared runs directory) or they fail here, saying so. One that
    a rank cannot load gives way to the complete one before it (:func:`loadable`).
    """
    choice: list[str | None] = [None]
    if d.is_main:
        path = requested
        if restart > 0:
            path = resume_checkpoint(run_dir)[0] or requested
        elif requested is not None:
            # Why the launch chose it over LATEST's, said at launch: said in the run's log too.
            chosen, why = resume_checkpoint(requested.parent.parent)
            if why and chosen is not None and chosen.resolve() == requested.resolve():
                out.log("info", why)
        choice[0] = str(Path(path).resolve()) if path else None
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path = Path(choice[0])
    if not (path / checkpoint.STATE).is_file():
        raise FileNotFoundError(
            f"rank {d.rank} cannot read rank 0's checkpoint {path}: on several nodes, resuming "
            "needs a runs directory every node can read (a shared file system)"
        )
    return loadable(path, d.world_size, lambda m: out.log("warning", m))


def apply(
    back: Resumed, point: Path, d: Dist, p, changes: list[dict], hooks: Hooks, out: Reporter
) -> tuple[int, int | None, DataPosition]:
    """A loaded checkpoint's step, newest eval and data position; its task state and RNG
    restored."""
    position = position_of(back.data, back.world_size, changes, p.data.batch_size)
    hooks.restore(back.task, d.world_size, lambda m: out.log("warning", m))
    if back.rng is not None:
        checkpoint.restore_rng(back.rng, d.device)
    else:
        out.log("warning", f"resumed on {d.world_size} ranks from {back.ranks}: RNG reseeded")
    out.log(
        "info",
        f"resumed from {point} at step {back.step} "
        f"(epoch {position.epoch}, sample {position.samples} of its order)",
    )
    return back.step, back.evaluated_at, position


class ResumeFailed(RuntimeError):
    """No checkpoint the run could resume from can be loaded on every rank."""


def load_problem(path: Path) -> str | None:
    """Why this rank cannot load the checkpoint at ``path`` (None: it loads). A truncated or
    damaged state.pt fails here, in torch's reader, before any of the run's objects change;
    a sharded checkpoint's shards are read by DCP afterwards."""
    try:
        checkpoint.load(path)
    except Exception as e:  # torch's reader raises RuntimeError, pickle's UnpicklingError...
        return _one_line(e)
    return None


def _one_line(e: Exception) -> str:
    """An exception as one line: a weights-only load failure's own reason, not its advice
    (to load with weights_only=False, which a damaged file would not survive either)."""
    text = str(e).split("WeightsUnpickler error:", 1)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def loadable(path: Path, world_size: int, log: Callable[[str], None]) -> Path:
    """Collective: the checkpoint every rank can load, ``path`` first, else the complete ones
    before it, newest first (rank 0's list), each one skipped said in one warning line
    (``log``); ResumeFailed in one line when none loads. Every rank returns the same one."""
    older = [
        Path(c["path"])
        for c in reversed(list_checkpoints(path.parent.parent))
        if c["step"] < checkpoint.step_of(path)
    ]
    candidates: list[Any] = [[str(path), *map(str, older)]]
    dist.broadcast_object_list(candidates, src=0)  # rank 0's view of the directory
    tried = [Path(c) for c in candidates[0]]
    for i, ckpt in enumerate(tried):
        problems: list[Any] = [None] * world_size
        dist.all_gather_object(problems, load_problem(ckpt))
        problem = next((p for p in problems if p), None)
        if problem is None:
            return ckpt
        rank = problems.index(problem)
        then = (
            f"resuming from {tried[i + 1].name}, the previous complete checkpoint"
            if i + 1 < len(tried)
            else "no earlier complete checkpoint is left"
        )
        log(f"checkpoint {ckpt.name} cannot be loaded on rank {rank} ({problem}); {then}")
    raise ResumeFailed(
        f"no checkpoint of {path.parent.parent.name} can be loaded (tried {len(tried)}: "
        f"{', '.join(c.name for c in tried)})"
    )
