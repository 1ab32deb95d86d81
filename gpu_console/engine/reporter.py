"""Events: one writer per run directory. Other ranks get a silent reporter.

On one machine the writer is rank 0. On several, every node has its own run directory and
the first rank of each node writes that node's ``events.jsonl`` (the numbers in it are the
global ones: losses and memory reach every rank through the log interval's collective).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..events import EventWriter


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

    def start(self, **fields: Any) -> None:
        self.event("start", **fields)

    def status(self, state: str, reason: str = "", **fields: Any) -> None:
        self.event("status", state=state, reason=reason, **fields)

    def log(self, level: str, message: str, **fields: Any) -> None:
        self.event("log", level=level, message=message, **fields)
        if self._w is not None:
            print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None
