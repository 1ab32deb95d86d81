"""Events (``events.jsonl``) and control commands (``control.jsonl``): writing and tailing.

One JSON object a line. Readers take only complete lines, so a torn last line (a writer
killed mid-write, or caught between write and flush) is left for the next read, and lines
that do not parse or have a kind they do not know are skipped. No torch here.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import diskfull, strict_json

VERSION = 1
KINDS = {
    "start", "step", "eval", "early_stop", "epoch", "progress", "checkpoint", "control",
    "status", "log", "profile",
}  # fmt: skip
CONTROL_COMMANDS = ("checkpoint", "stop", "pause", "resume", "profile")


class EventWriter:
    """Append-only writer for rank 0. Each event is one ``write`` of a whole line.

    A full disk (ENOSPC, EDQUOT) must neither end the run nor tear the file: an append that
    fails is cut back off the file (no half line for the next event to be glued to), and the
    events not written wait, in order, to be written before the next one (at most
    :data:`MAX_PENDING`; the oldest step events go first). :attr:`failing` says since when
    appends fail and why, for the engine to give up after a while. Another error raises.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[tuple[str, bytes]] = []
        self.failing: tuple[float, diskfull.DiskFull] | None = None  # (since, why)
        self.dropped: Counter[str] = Counter()  # events given up for want of room, by kind

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"v": VERSION, "t": round(time.time(), 3), "kind": kind, **fields}
        line = strict_json.dumps(event, separators=(",", ":")) + "\n"
        self._pending.append((kind, line.encode()))
        self.flush()
        return event

    def flush(self) -> bool:
        """Write the events waiting: True once none is left."""
        while self._pending:
            try:
                diskfull.append_whole(self._fd, self._pending[0][1])
            except OSError as e:
                full = diskfull.classify(e, self.path)
                if full is None:
                    raise
                if self.failing is None:
                    self.failing = (time.monotonic(), full)
                self._bound()
                return False
            self._pending.pop(0)
        self.failing = None
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _bound(self) -> None:
        """Past MAX_PENDING, the oldest of the events a reader can do without goes: progress,
        then step, then log lines; never a start, status, eval, checkpoint, control or
        profile event (the run's story; they are few, so the queue stays small)."""
        for kind in DROPPABLE:
            while len(self._pending) > MAX_PENDING:
                i = next((i for i, (k, _) in enumerate(self._pending) if k == kind), None)
                if i is None:
                    break
                self._pending.pop(i)
                self.dropped[kind] += 1

    def drop_steps(self) -> None:
        """Give up the step events waiting but the newest (the run's end is at stake)."""
        steps = [i for i, (kind, _) in enumerate(self._pending) if kind == "step"]
        for i in reversed(steps[:-1]):
            self._pending.pop(i)
            self.dropped["step"] += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


MAX_PENDING = 10_000
DROPPABLE = ("progress", "step", "log")  # in the order a full queue gives them up


class JsonlTail:
    """Follows a JSONL file from a byte offset; :meth:`read` returns the new whole lines."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = Path(path)
        self.offset = offset

    def read(self, max_bytes: int | None = None) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read() if max_bytes is None else f.read(max_bytes)
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return list(_parse_lines(chunk[: end + 1]))


def _parse_lines(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            obj = strict_json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield obj


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every known event of a file (torn last line and unknown kinds skipped)."""
    return [e for e in JsonlTail(path).read() if e.get("kind") in KINDS]


def append_control(run_dir: Path, cmd: str, **args: Any) -> str:
    """Append one command to the run's control file (mode 0600); return its id.

    ``args`` ride in the same line (``profile``'s ``steps``)."""
    if cmd not in CONTROL_COMMANDS:
        raise ValueError(f"unknown control command {cmd!r}")
    return append_command(Path(run_dir) / "control.jsonl", cmd, **args)


def append_command(path: Path, cmd: str, **args: Any) -> str:
    """One command line (``id``, ``cmd``, ``t``, ``args``) appended whole to a control file
    (mode 0600: a run's, a sweep's); its id."""
    cid = uuid.uuid4().hex[:12]
    append_line(path, {"id": cid, "cmd": cmd, "t": round(time.time(), 3), **args}, 0o600)
    return cid


def append_line(path: Path, obj: dict[str, Any], mode: int = 0o644) -> None:
    """``obj`` as one strict JSON line, appended in a single write (readers never see half)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.write(fd, (strict_json.dumps(obj) + "\n").encode())
    finally:
        os.close(fd)
