"""A rank's run: the process group, the trainer (trainer.py), and how the run ends.

The training itself reads top to bottom in trainer.py. Here: what is set up before it (the
process group, the reporter, the OOM memory history) and what its failures become (the
run's status, an OOM's advice, the task's ``close()``).

What can go wrong, and what the run does about it:

- A scheduler signal (SIGTERM/SIGUSR1, see signals.py): every rank stops at the same step
  boundary, checkpoints (reason ``signal``) and exits 0.
- A non-finite loss with ``nan_policy = "stop"``: the gradient norm (all-reduced, so the
  same on every rank) is checked before each update; the first non-finite one stops every
  rank before the update, checkpoints the last finite state (reason ``nan``), then fails
  naming the step. (With an fp16 GradScaler, inf/nan gradients are the scaler's business and
  the loss is checked at each log interval instead.) On GPUs the check gates the update on
  the device and the host reads it at the next step where it syncs anyway (nonfinite.py).
- CUDA out of memory: the rank fails with its peak memory and what to change (and, with
  ``hardware.memory_snapshot_on_oom``, a CUDA memory snapshot named in the failure).
- A checkpoint that cannot be written (a full disk): the previous one stays complete and
  named in LATEST; an error event says so and the run goes on (a stop then ends without a
  checkpoint, which the supervisor records). Writes run in the background
  (checkpoint_writer.py): a failed one is reported at the next step boundary.
- A restart by torchrun (``distributed.max_restarts``): the run resumes from its own LATEST.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..profile import Profile
from ..tasks.base import Task
from ..timings import Stopwatch
from . import checkpoint, torch_profiler
from . import distributed as distmod
from . import resume as resuming
from .build import Setup
from .control_handler import DiskFullStop
from .failure_checkpoint import AfterUpdateFailed
from .heartbeat import Heartbeat
from .metrics import memory_sample
from .nonfinite import NonFiniteLoss
from .refusal import Refused
from .reporter import Reporter
from .trainer import Trainer

__all__ = ["DiskFullStop", "NonFiniteLoss", "OutOfMemory", "close_task", "oom_message", "train"]


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory on this rank; the message says how much and what to change."""


class _NullHeartbeat:
    step = 0
    phase = "starting"

    def set(self, step: int, phase: str, detail: str = "") -> None:
        self.step = step


def train(
    run_dir: Path,
    profile: Profile,
    task: Task,
    device_type: str,
    resume: Path | None,
    heartbeat: Heartbeat | None = None,
    restart: int = 0,
    changes: list[dict] | None = None,
    stopwatch: Stopwatch | None = None,
):
    p = profile
    watch = stopwatch or Stopwatch()
    # Signals, CPU placement and determinism are the process's: its entry point set them
    # (__main__.process_setup). A process group this process already has is the run's.
    d = distmod.init(p.distributed, p.hardware, device_type)
    watch.mark("process_group")
    out = Reporter(run_dir, d.local_rank == 0)
    beat = heartbeat or _NullHeartbeat()
    oom_snapshot = torch_profiler.record_memory_history(p.hardware.memory_snapshot_on_oom, d.device)
    trainer: Trainer | None = None
    try:
        try:
            setup = Setup(run_dir, p, task, d, out, resume, beat, restart, changes or [], watch,
                          oom_snapshot)  # fmt: skip
            trainer = Trainer(setup)
            trainer.run()
        except torch.OutOfMemoryError as e:  # torch.cuda.OutOfMemoryError is this class
            snapshot = torch_profiler.dump_memory_snapshot(run_dir, d.rank, oom_snapshot)
            # The step the loop was in (its heartbeat knows), counted from 1 like step events.
            raise OutOfMemory(oom_message(e, d, p, beat.step, snapshot)) from e
    except Refused as e:
        # The user's input, judged where it could first be (every rank the same verdict):
        # reported as a launch check's refusal, one line and exit 2, and not restarted.
        out.status("refused", reason=str(e)[:500], key=e.key, step=_done_step(beat, resume))
        if trainer is not None:
            trainer.land_write()  # an interval checkpoint still being written completes
    except (NonFiniteLoss, DiskFullStop, resuming.ResumeFailed) as e:
        # A policy decision every rank made at the same step, not a crash: a restart would
        # not help, so the ranks exit 0 and the status says failed (the supervisor records
        # the engine's reason as the failure).
        why = str(e) if isinstance(e, DiskFullStop) else f"{type(e).__name__}: {e}"
        out.status("failed", reason=why[:500], step=_done_step(beat, resume))
        if trainer is not None:
            trainer.land_write()
    except BaseException as e:
        # With restarts left, torchrun starts the group again (from LATEST): not the end.
        again = restart < p.distributed.max_restarts
        named = isinstance(e, AfterUpdateFailed)  # its message names what failed
        out.status(
            "restarting" if again else "failed",
            reason=(str(e) if named else f"{type(e).__name__}: {e}")[:500],
            step=_done_step(beat, resume),
        )
        if isinstance(e, OutOfMemory):
            out.log("error", str(e))
        if trainer is not None:
            trainer.land_write()  # the previous step's checkpoint, still being written
        raise
    finally:
        if trainer is not None:
            trainer.release()  # what is process-wide goes with the run (a harness's next)
        torch_profiler.after_failure()  # a capture a failure cut short writes what it has
        close_task(task, out, d.rank)
        out.close()
        if d.owned and dist.is_initialized():
            dist.destroy_process_group()


def close_task(task: Task, out: Reporter, rank: int) -> None:
    """The task's optional ``close()``: on every rank, however the run ended.

    Its failure is reported (a warning event, the traceback on the rank's stderr) and does
    not change how the run ended: the run's status is already written.
    """
    close = getattr(task, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as e:
        traceback.print_exc()
        out.log("warning", f"the task's close() failed on rank {rank}: {type(e).__name__}: {e}")


def _done_step(beat, resume: Path | None = None) -> int:
    """The last step completed: the heartbeat's step is in progress in its first phases.
    Before the session's first step (its heartbeat not moved yet), a resumed session is at
    the step it resumes from (``resume``'s: a ResumeFailed, a corrupted checkpoint, leaves
    the run at the step it had reached), never 0."""
    if resume is not None and beat.step == 0 and beat.phase == "starting":
        return checkpoint.step_of(resume)
    return beat.step - 1 if beat.phase in ("data", "compute", "update") else beat.step


ADVICE = (
    "lower data.batch_size (now {bs}) and raise train.grad_accum (now {ga}) to keep the "
    "global batch; {prec}activation checkpointing in the task's model "
    "(torch.utils.checkpoint); a smaller model"
)


def oom_message(
    e: BaseException, d, p: Profile, bad_step: int, snapshot: Path | None = None
) -> str:
    """What ran out, how much this rank had at its peak, and what to change."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    peak = total = None
    if d.device.type == "cuda":
        with contextlib.suppress(Exception):
            peak = torch.cuda.max_memory_allocated(d.device)
            total = torch.cuda.get_device_properties(d.device).total_memory
            torch.cuda.empty_cache()
    else:
        peak = memory_sample(d.device)[2]
    where = f"rank {d.rank} ran out of memory on {d.device} in step {bad_step}"
    sizes = ""
    if peak is not None:
        sizes = f"; peak {_gib(peak)}" + (f" of {_gib(total)}" if total else "")
    full = p.train.precision == "fp32" or (p.train.precision == "auto" and d.device.type == "cpu")
    lower = f"train.precision = bf16 (now {p.train.precision}); " if full else ""
    advice = ADVICE.format(bs=p.data.batch_size, ga=p.train.grad_accum, prec=lower)
    if snapshot is not None:  # first: the status keeps a reason's first 500 characters
        where += f" (CUDA memory snapshot: {snapshot}, open it in pytorch.org/memory_viz)"
    return f"{where} ({first}){sizes}. To fit: {advice}"


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
