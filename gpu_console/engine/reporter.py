"""Events: one writer per run directory. Other ranks get a silent reporter.

On one machine the writer is rank 0. On several, every node has its own run directory and
the first rank of each node writes that node's ``events.jsonl`` (the numbers in it are the
global ones: losses and memory reach every rank through the log interval's collective).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .. import diskfull
from ..events import EventWriter

# Events that cannot be written for this long (a full disk nobody frees) end the run:
# training on blind, with no checkpoint and nothing the console can show, helps nobody.
GIVE_UP_ENV = "GPU_CONSOLE_EVENTS_GIVE_UP_S"
GIVE_UP_S = 300.0


def end_torn_line(path: Path) -> None:
    """A writer killed mid-line (kill -9, a restart) leaves a torn last line: close it.

    Otherwise the next writer's first event would be glued to the torn half and lost.
    """
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        return


class Reporter:
    def __init__(self, run_dir: Path, active: bool):
        self._w = None
        self._dropped_said: Counter[str] = Counter()
        self.run_dir = Path(run_dir)
        if active:
            path = Path(run_dir) / "events.jsonl"
            end_torn_line(path)
            self._w = EventWriter(path)

    @property
    def active(self) -> bool:
        """True in the one rank of this run directory that writes its events."""
        return self._w is not None

    def event(self, kind: str, **fields: Any) -> None:
        if self._w is not None:
            self._w.emit(kind, **fields)
            self._say_dropped()

    def _say_dropped(self) -> None:
        """Once events are written again, a warning for the step events a full disk lost."""
        assert self._w is not None
        lost = self._w.dropped - self._dropped_said
        if lost and not self._w.pending:
            self._dropped_said = self._w.dropped.copy()
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(lost.items()))
            message = f"{lost.total()} events were lost while the disk was full ({kinds})"
            self._w.emit("log", level="warning", message=message)

    def start(self, **fields: Any) -> None:
        self.event("start", **fields)

    def status(self, state: str, reason: str = "", **fields: Any) -> None:
        self.event("status", state=state, reason=reason, **fields)

    def log(self, level: str, message: str, **fields: Any) -> None:
        self.event("log", level=level, message=message, **fields)
        if self._w is not None:
            with contextlib.suppress(OSError):  # the rank's stderr file is on the same disk
                print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def unwritable(self) -> str | None:
        """Why the run must end, once events have not been written for ``GIVE_UP_S``."""
        failing = self._w.failing if self._w is not None else None
        if failing is None:
            return None
        since, why = failing
        waited = time.monotonic() - since
        if waited < float(os.environ.get(GIVE_UP_ENV) or GIVE_UP_S):
            return None
        return f"events.jsonl not written for {waited:.0f} s: {why}"

    def close(self) -> None:
        if self._w is not None:
            if not self._w.flush():
                self._last_words()
            self._w.close()
            self._w = None

    def _last_words(self) -> None:
        """Events still unwritten at the end (a full disk): the engine's reserve is freed for
        them, and if that is not room enough, the step events give way to the rest (the
        status that says how the run ended above all)."""
        assert self._w is not None
        diskfull.free_reserve(self.run_dir, "engine")
        if not self._w.flush():
            self._w.drop_steps()
            self._w.flush()
