"""What a task knows about its run: :class:`TaskContext`, the same object on every call.

The engine gives it to the task once, before anything else, by assigning ``task.ctx``
(before ``build_model``, on every rank); the optional hooks (hooks.py) also receive it as
their last argument. It is how a task learns its rank, device, step and where to write,
instead of reading ``sys.argv`` or ``RANK``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..profile import Profile

LEVELS = ("info", "warning", "error")
TASK_DIR = "task"


@dataclass
class TaskContext:
    """One rank's view of the run. The engine keeps ``step`` and ``epoch`` current.

    - ``rank``, ``world_size``, ``local_rank``: this process's place (torchrun's numbers).
    - ``device``: the rank's ``torch.device`` (batches arrive on it; the model lives on it).
    - ``step``: optimizer steps done (in ``on_step_end``: including the one just made).
    - ``epoch``: the train data's epoch the last step drew from, from 0 (in
      ``on_epoch_end``: the epoch that just ended).
    - ``run_dir``: the run's directory; ``task_dir`` (``run_dir/task``, made by the engine):
      where the task writes its own files (samples, images). Every rank may write there:
      name files per rank, or write from rank 0 only.
    - ``profile``: the resolved profile as typed objects (``profile.data.batch_size``,
      ``profile.train.grad_accum``, ``profile.train.max_steps``, ``profile.task``...).
    - ``resumed``: this run continues from a checkpoint; ``start_step``: its step (else 0).
    - ``batch_in_epoch``: the train batches this rank has drawn from ``epoch`` (in
      ``on_step_end``: including the step's; at an epoch's last step, all of its batches).
    - ``optimizers``: the run's optimizers by name (``"main"``, or the task's own names),
      for a hook that reads or sets their state (e.g. an lr).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    run_dir: Path
    profile: Profile
    resumed: bool = False
    start_step: int = 0
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    optimizers: dict[str, Any] = field(default_factory=dict)
    _emit: Callable[[str, str], None] | None = field(default=None, repr=False)

    @property
    def task_dir(self) -> Path:
        return self.run_dir / TASK_DIR

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, message: str, level: str = "info") -> None:
        """A line for the console's log pane and the headless output (a ``log`` event).

        Rank 0's lines are events as they are. Another rank's are prefixed ``rank N:`` and
        go to that rank's own output (``logs/``); on several nodes, the first rank of each
        node writes its node's events, so its lines are events too (prefixed).
        """
        if level not in LEVELS:
            raise ValueError(f"ctx.log: level must be one of {', '.join(LEVELS)} (got {level!r})")
        text = str(message) if self.rank == 0 else f"rank {self.rank}: {message}"
        if self._emit is not None:
            self._emit(level, text)
        else:
            print(f"[{level}] {text}", file=sys.stderr, flush=True)


def make(d: Any, run_dir: Path, profile: Profile, resumed: bool, start_step: int, out: Any):
    """The engine's context for rank ``d`` (distributed.Dist); ``out``: its Reporter."""
    ctx = TaskContext(
        rank=d.rank,
        world_size=d.world_size,
        local_rank=d.local_rank,
        device=d.device,
        run_dir=Path(run_dir),
        profile=profile,
        resumed=resumed,
        start_step=start_step,
        step=start_step,
    )
    if out.active:
        ctx._emit = lambda level, text: out.log(level, text, source="task")
    ctx.task_dir.mkdir(parents=True, exist_ok=True)  # every rank: whoever is first makes it
    return ctx


@contextlib.contextmanager
def planning(
    profile: Profile, world_size: int, device_type: str, scratch: str | None = None
) -> Iterator[TaskContext]:
    """Rank 0's context for ``run --dry-run``, a launch's data check (plan.py) and a
    resume's model check (model_match.py): its run directory is ``scratch``, a temporary one
    the console made and removes (a planning process it kills runs no exit handler), else
    one of its own, removed when the block ends (a harness rank or the pytest worker that
    plans runs no exit handler either). Its log lines go nowhere."""
    import torch

    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gpu-console-plan-", ignore_cleanup_errors=True)
            )
        ctx = TaskContext(0, world_size, 0, torch.device(device_type), Path(scratch), profile)
        ctx._emit = lambda level, text: None
        ctx.task_dir.mkdir()
        yield ctx
