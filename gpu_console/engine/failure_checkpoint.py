"""A run is never lost to code outside the update: when an eval, a task's hook, logging or the
profiler's export fails after an update has completed, the model and optimizers hold a
consistent post-step state, so it is checkpointed (reason ``failure``) before the run ends
failed, naming what failed. A resume after the fix goes on exactly from it.

A failure inside the update (compute, backward, the optimizer's step) is not caught here:
the state may be half-updated, so nothing is written and LATEST stays the last good one.

Agreement across ranks: a save is collective, and the failure may be one rank's alone (its
peers then wait in a collective of the eval, or are already in the next step). So the ranks
first agree, on a gloo group of their own (not the training group, whose collectives a
peer may be inside) with a short timeout (:data:`AGREE_S`): every rank must have failed
after the same step, at the same place. Only then do they save. A rank whose peers do not
all answer in time (they did not fail, or failed elsewhere) ends without a checkpoint: a
run that ends at once, its LATEST the last interval checkpoint, is better than one that
hangs for the collective timeout. Its peers are then ended by torchrun as for any crash.
"""

from __future__ import annotations

import zlib
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from .checkpoint import step_dir_name
from .control_handler import DiskFullStop
from .nonfinite import NonFiniteLoss
from .refusal import Refused

if TYPE_CHECKING:
    from pathlib import Path

    from .checkpointer import Checkpointer
    from .distributed import Dist
    from .reporter import Reporter
    from .train_state import TrainState

# How long a failed rank waits for every other one to have failed at the same place. Ranks
# that fail together (a task's bug hits every rank) meet within a second; a peer that did
# not fail never comes, and the rank ends without a checkpoint after this wait.
AGREE_S = 10.0

# Decisions every rank made together, each with its own checkpoint policy (nan_stop.py, the
# events' disk), and a user's input the ranks refuse (refusal.py, recorded as ``refused``
# by the loop): never a failure of code outside the update.
POLICY: tuple[type[BaseException], ...] = (NonFiniteLoss, DiskFullStop, Refused)


class Failed(Exception):
    """Code outside the update failed: the message names it (``eval 'val' failed: ...``);
    ``what`` is the place (``eval 'val'``), which the ranks agree on."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")
        self.what = what


def _as_failed(what: str, e: BaseException | None) -> Failed | None:
    """The :class:`Failed` an exception of the code ``what`` becomes; None when it passes
    through as it is (none, a Failed already, a policy decision, not an Exception)."""
    if e is None or not isinstance(e, Exception) or isinstance(e, (Failed, *POLICY)):
        return None
    failed = Failed(what, describe(e))
    failed.__cause__ = e
    return failed


# Classes, not @contextmanager generators: four guards are entered at every step, and a
# generator's context manager costs several times as much on a step of a few milliseconds.
class naming:  # noqa: N801 - used as a function: `with naming("eval"):`
    """An exception of the code inside becomes :class:`Failed`, naming ``what``."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if (failed := _as_failed(self.what, e)) is not None:
            raise failed


def describe(e: BaseException) -> str:
    """``KeyError: 'x'``: an exception's type and the last line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


class AfterUpdateFailed(RuntimeError):
    """The run failed outside the update; the message says whether its state was saved."""


class FailureCheckpoint:
    def __init__(
        self, d: Dist, out: Reporter, state: TrainState, checkpointer: Checkpointer, run_dir: Path
    ) -> None:
        self.d, self.out, self.state = d, out, state
        self.checkpointer, self.run_dir = checkpointer, run_dir
        # Collective, at setup (every rank creates its groups in the same order).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_S))

    def guard(self, what: str) -> _Guard:
        """Code after the update: its failure checkpoints the state, then fails the run."""
        return _Guard(self, what)

    def fail(self, e: Failed) -> NoReturn:
        step = self.state.step
        why = f"{e} (after step {step})"
        if step == 0:  # nothing trained yet: nothing to keep
            raise AfterUpdateFailed(why) from e
        if not self._agree(step, e.what):
            kept = "no failure checkpoint: not every rank failed there"
            raise AfterUpdateFailed(f"{why}; {kept}") from e
        name = step_dir_name(step)
        if self._already_saved(step):  # the end's eval after the step's own checkpoint
            raise AfterUpdateFailed(f"{why}; checkpoint {name} holds the state") from e
        try:
            saved = self.checkpointer.save("failure")
        except Exception as s:  # the task's state_dict() may be what is broken
            saved = False
            self.out.log("error", f"checkpoint @ step {step} (failure) not written: {describe(s)}")
        if not saved:
            raise AfterUpdateFailed(f"{why}; the failure checkpoint could not be written") from e
        resume = f"fix it, then: gpu-console run --resume {self.run_dir.absolute()}"
        self.out.log("error", f"checkpoint @ step {step} (failure) written: {name} holds the "
                     f"state after step {step}, before {e}; {resume}")  # fmt: skip
        raise AfterUpdateFailed(f"{why}; checkpoint {name} (failure) holds the state") from e

    def _already_saved(self, step: int) -> bool:
        """Whether this session's newest complete checkpoint is of ``step`` (the write in
        flight waited for first: collective, as every rank agreed to get here)."""
        self.checkpointer.save(None)
        return self.checkpointer.newest.at(step) is not None

    def _agree(self, step: int, what: str) -> bool:
        """Whether every rank failed after ``step`` at ``what`` (bounded by AGREE_S)."""
        if self.d.world_size == 1:
            return True
        mine = torch.tensor([step, zlib.crc32(what.encode())], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.d.world_size)]
        try:
            dist.all_gather(every, mine, group=self.group)
        except Exception:  # a peer that did not fail (timeout) or died (connection reset)
            return False
        return all(bool(torch.equal(t, mine)) for t in every)


class _Guard:
    __slots__ = ("owner", "what")

    def __init__(self, owner: FailureCheckpoint, what: str) -> None:
        self.owner, self.what = owner, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        failed = e if isinstance(e, Failed) else _as_failed(self.what, e)
        if failed is not None:
            self.owner.fail(failed)
