"""The profiler on demand (the ``profile`` command) and the CUDA memory snapshot on OOM.

A ``profile`` command with K steps reaches every rank at the same step (control.py); from
there each rank runs ``torch.profiler`` over the next K + 1 steps (one warmup step, whose
start-up costs the trace leaves out, then K recorded), driven by ``prof.step()`` at each
step's end, and writes its own trace into the run directory::

    profiles/step-<first recorded step, 8 digits>/rank<R>.pt.trace.json

Chrome trace JSON (``export_chrome_trace``): Perfetto (ui.perfetto.dev) opens a file as it
is, and TensorBoard's profiler plugin (torch-tb-profiler) reads ``profiles/`` as its logdir:
one run per capture, one worker per ``<worker>.pt.trace.json`` file. When every rank has
written (one small collective), the first rank logs the path, writes a ``profile`` event and
acknowledges the command ``done`` with the path.

A capture ends early, and is still written, when the run stops (a command or a signal),
reaches max_steps, or is paused (a paused run makes no steps: the trace holds the steps
before the pause); cut short before a step was recorded, it leaves no file and its ack is
``rejected``, saying so. A profile request while a capture is in progress, or while the run is
paused, is rejected, saying why (no queue: the console sends it again when it wants). When
a rank fails during a capture, it writes what it captured, without the collective (best
effort: the ack and the event are not written).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import torch_private
from .control import MAX_PROFILE_STEPS

WARMUP_STEPS = 1
# Allocation events kept by the CUDA memory history: enough for the steps before an OOM.
MEMORY_HISTORY_ENTRIES = 100_000

_failed_capture: list[Any] = []  # the capture in progress, for a failure's best effort


def trace_name(rank: int) -> str:
    """A rank's trace file: ``<worker>.pt.trace.json`` as TensorBoard's plugin expects."""
    return f"rank{rank}.pt.trace.json"


@dataclass
class Capture:
    folder: Path
    first: int  # the first step captured (the warmup step)
    steps: int  # K: the steps recorded after the warmup
    ack: Callable[..., None]  # acknowledges the command (on the node whose file held it)
    prof: Any = None  # the torch.profiler.profile, once started
    calls: int = 0  # prof.step() calls so far
    written: Path | None = None  # this rank's trace, once written

    @property
    def last(self) -> int:
        return self.first + WARMUP_STEPS + self.steps - 1


class Profiler:
    """At most one capture at a time, on every rank at the same steps."""

    def __init__(self, run_dir: Path, d, out, with_stack: bool = False):
        self.run_dir, self.d, self.out = Path(run_dir), d, out
        self.with_stack = with_stack
        self.capture: Capture | None = None

    def request(self, step: int, steps: int, paused: bool, ack: Callable[..., None]) -> None:
        """The ``profile`` command, decided at ``step``: capture from step + 1, or reject it.

        ``ack(state, step, **fields)`` acknowledges it: ``rejected`` now, ``done`` once every
        rank has written its trace."""
        why = None
        if steps <= 0:
            why = f"steps must be an integer from 1 to {MAX_PROFILE_STEPS}"
        elif paused:
            why = "the run is paused: resume it, then profile"
        elif self.capture is not None:
            c = self.capture
            why = f"a capture of steps {c.first}-{c.last} is in progress ({c.folder})"
        if why is not None:
            self.out.log("warning", f"profile request rejected: {why}")
            ack("rejected", step, reason=why)
            return
        first = step + 1
        # Named after its first recorded step (the warmup step is not in the trace).
        folder = self.run_dir / "profiles" / f"step-{first + WARMUP_STEPS:08d}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.d.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        capture = Capture(folder, first, steps, ack)
        capture.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=WARMUP_STEPS, active=steps, repeat=1),
            on_trace_ready=lambda prof: self._write(capture, prof),
            record_shapes=True,
            profile_memory=True,
            with_stack=self.with_stack,
        )
        capture.prof.start()
        self.capture = capture
        _failed_capture[:] = [self]
        self.out.log("info", f"profiling steps {first + WARMUP_STEPS}-{capture.last} into {folder}")

    def step_end(self, step: int) -> None:
        """Every rank, after each step: the profiler's schedule moves on; the capture ends
        after its last step (the trace is written inside ``prof.step()``)."""
        c = self.capture
        if c is None:
            return
        c.prof.step()
        c.calls += 1
        if c.calls == WARMUP_STEPS + c.steps:
            self._end(step, "complete")

    def finish(self, step: int, reason: str) -> None:
        """Every rank at the same step (a stop, a signal, a pause, the run's end): a capture in
        progress ends here, and what it recorded is written."""
        if self.capture is not None:
            self._end(step, reason)

    def _end(self, step: int, reason: str) -> None:
        c, self.capture = self.capture, None
        assert c is not None  # its callers end a capture in progress
        _failed_capture.clear()
        try:
            c.prof.stop()  # mid-record: writes the steps recorded so far (on_trace_ready)
        except Exception as e:  # the ack below then says no trace was written
            self.out.log("warning", f"profile: rank {self.d.rank}: the profiler failed: {e}")
        # Every rank's verdict in one small collective: the ack says the traces are there.
        ok = torch.tensor([1 if c.written else 0], device=self.d.device)
        dist.all_reduce(ok)
        wrote, world = int(ok.item()), self.d.world_size
        captured = max(0, min(step, c.last) - c.first - WARMUP_STEPS + 1)
        fields = {
            "path": str(c.folder),
            "first_step": c.first + WARMUP_STEPS,
            "last_step": c.first + WARMUP_STEPS + captured - 1,
            "steps": captured,
            "ranks": wrote,
            "ended_by": reason,  # complete, stop, signal, pause or end
        }
        if wrote == 0 or captured == 0:
            if c.written is not None:  # the warmup step's alone: not a trace of any step
                with contextlib.suppress(OSError):
                    c.written.unlink()
                    c.folder.rmdir()  # the last rank to get here removes it
            why = "before a step was recorded" if captured == 0 else "no rank could write it"
            message = f"profile: no trace written ({reason} {why})"
            self.out.log("warning", message)
            c.ack("rejected", step, reason=message, **fields)
            return
        span = f"steps {fields['first_step']}-{fields['last_step']}"
        missing = (
            f" ({world - wrote} of {world} ranks could not write theirs)" if wrote < world else ""
        )
        early = "" if reason == "complete" else f", cut short by {reason}"
        self.out.log(
            "warning" if missing else "info",
            f"profile: {span} traced on {wrote} ranks{early}: {c.folder}{missing} "
            "(open a rank's .pt.trace.json in ui.perfetto.dev, or "
            f"tensorboard --logdir {c.folder.parent})",
        )
        self.out.event("profile", **fields)
        c.ack("done", step, **fields)

    def _write(self, c: Capture, prof) -> None:
        try:
            c.folder.mkdir(parents=True, exist_ok=True)
            path = c.folder / trace_name(self.d.rank)
            prof.export_chrome_trace(str(path))
            c.written = path
        except Exception as e:  # a full disk must not end the run: the capture says so
            self.out.log("warning", f"profile: rank {self.d.rank} could not write its trace: {e}")

    def abandon(self) -> None:
        """A failure during a capture: write this rank's trace, no collective, no ack."""
        c, self.capture = self.capture, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.prof.stop()


def after_failure() -> None:
    """Called as a rank fails: a capture in progress writes what it has (best effort)."""
    for profiler in _failed_capture:
        profiler.abandon()
    _failed_capture.clear()


# -- the CUDA memory snapshot on OOM ----------------------------------------------------------


def record_memory_history(enabled: bool, device: torch.device) -> str:
    """``hardware.memory_snapshot_on_oom``: start recording allocations (CUDA only). Returns
    what the start event says: ``on``, ``off``, or why it has no effect."""
    if not enabled:
        return "off"
    if device.type != "cuda":
        return "no effect without CUDA"
    return torch_private.record_memory_history(MEMORY_HISTORY_ENTRIES)


def dump_memory_snapshot(run_dir: Path, rank: int, recording: str) -> Path | None:
    """On an OOM, when :func:`record_memory_history` said ``on``: the snapshot beside the
    failure (open it at pytorch.org/memory_viz), else None."""
    if recording != "on":
        return None
    path = Path(run_dir) / f"oom-memory-rank{rank}.pickle"
    try:
        torch_private.dump_memory_snapshot(str(path))
    except Exception:
        return None
    return path if path.is_file() else None
