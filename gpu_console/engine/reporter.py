"""Rank 0's events: the only writer of ``events.jsonl``. Other ranks get a silent one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..events import EventWriter


class Reporter:
    def __init__(self, run_dir: Path, is_main: bool):
        self._w = EventWriter(Path(run_dir) / "events.jsonl") if is_main else None

    def event(self, kind: str, **fields: Any) -> None:
        if self._w is not None:
            self._w.emit(kind, **fields)

    def start(self, **fields: Any) -> None:
        self.event("start", **fields)

    def status(self, state: str, reason: str = "") -> None:
        self.event("status", state=state, reason=reason)

    def log(self, level: str, message: str) -> None:
        self.event("log", level=level, message=message)
        if self._w is not None:
            print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None
