"""Reading a run's files fast, whatever their size (no Textual, no torch).

A run of a million steps has an ``events.jsonl`` of hundreds of MB: parsing every line takes
longer than anyone waits for a screen. :func:`quick_events` reads what a screen needs first,
in a time that does not grow with the file: the head (``start``), the newest
:data:`TAIL_BYTES` in full, and :data:`SAMPLES` step events picked at even byte offsets over
the rest (a whole-run loss curve, downsampled). :func:`backfill_events` then finds the rare
events of the skipped middle (evals, checkpoints, controls, logs) with one regular-expression
scan of a memory map, without parsing the step lines around them.

Every function returns ``(offset, event)`` pairs, so callers can order events by where they
are in the file; torn and malformed lines are skipped as :mod:`gpu_console.events` does.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Any

from .. import strict_json
from ..events import KINDS

SMALL_BYTES = 4 * 2**20  # files up to this size are parsed in full
TAIL_BYTES = 2 * 2**20
HEAD_BYTES = 64 * 2**10
SAMPLES = 2000
_PROBE = 8 * 2**10  # bytes read at each sample offset (several lines of any event)
RARE = re.compile(rb'"kind"\s*:\s*"(?:start|eval|checkpoint|control|status|log)"')

Located = tuple[int, dict[str, Any]]


def _parse(line: bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        obj = strict_json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and obj.get("kind") in KINDS else None


def _lines(data: bytes, base: int) -> list[Located]:
    """Complete lines of ``data`` (which starts at a line start) parsed, with their offsets."""
    out: list[Located] = []
    pos = 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            return out
        e = _parse(data[pos:end])
        if e is not None:
            out.append((base + pos, e))
        pos = end + 1


class QuickRead:
    """The result of :func:`quick_events`."""

    def __init__(self, events: list[Located], end: int, size: int, gap: tuple[int, int] | None):
        self.events = events  # in file order
        self.end = end  # byte offset after the last complete line: tailing continues here
        self.size = size
        self.gap = gap  # (start, stop) byte range only sampled, for :func:`backfill_events`

    @property
    def sampled(self) -> bool:
        return self.gap is not None


def quick_events(path: Path, small: int = SMALL_BYTES, tail: int = TAIL_BYTES) -> QuickRead:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, mmap needs the descriptor
    except FileNotFoundError:
        return QuickRead([], 0, 0, None)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size <= small:
            data = f.read()
            end = data.rfind(b"\n") + 1
            return QuickRead(_lines(data[:end], 0), end, size, None)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            end = mm.rfind(b"\n") + 1
            # The tail, in full, from the first line start at or after end - tail.
            tail_start = mm.find(b"\n", max(0, end - tail) - 1) + 1 if end > tail else 0
            events = _lines(mm[tail_start:end], tail_start)
            head_end = mm.rfind(b"\n", 0, min(HEAD_BYTES, tail_start)) + 1
            head = _lines(mm[:head_end], 0)
            events = head + _sampled_steps(mm, head_end, tail_start) + events
            return QuickRead(events, end, size, (head_end, tail_start))


def _sampled_steps(mm: mmap.mmap, start: int, stop: int, samples: int = SAMPLES) -> list[Located]:
    """One step event near each of ``samples`` evenly spaced offsets in [start, stop)."""
    out: list[Located] = []
    if stop - start <= 0:
        return out
    stride = max(1, (stop - start) // samples)
    last = -1
    for at in range(start, stop, stride):
        # The first line that starts after ``at`` (a line start at ``at`` itself counts).
        line_start = at if at == 0 or mm[at - 1 : at] == b"\n" else mm.find(b"\n", at, stop) + 1
        if line_start <= 0 or line_start <= last or line_start >= stop:
            continue
        chunk = mm[line_start : min(stop, line_start + _PROBE)]
        pos = 0
        while True:  # the first step line in the chunk (an eval may sit between steps)
            nl = chunk.find(b"\n", pos)
            if nl < 0:
                break
            e = _parse(chunk[pos:nl])
            if e is not None and e.get("kind") == "step":
                out.append((line_start + pos, e))
                last = line_start + pos
                break
            pos = nl + 1
    return out


def backfill_events(path: Path, gap: tuple[int, int]) -> list[Located]:
    """Every non-step event in the byte range ``gap``, found without parsing step lines."""
    start, stop = gap
    out: list[Located] = []
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return out
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for m in RARE.finditer(mm, start, stop):
            line_start = mm.rfind(b"\n", 0, m.start()) + 1
            line_end = mm.find(b"\n", m.end(), stop)
            if line_end < 0:
                continue
            e = _parse(mm[line_start:line_end])
            if e is not None and e.get("kind") != "step":
                out.append((line_start, e))
    return out


def tail_text(path: Path, offset: int | None, max_bytes: int = 64 * 2**10) -> tuple[list[str], int]:
    """New complete lines of a text file from ``offset`` (None: about the last ``max_bytes``).

    Returns the lines and the next offset. A flood larger than ``max_bytes`` since the last
    read keeps only its end; a file that shrank (rewritten) is read again from its start.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if offset is not None and offset > size:
                offset = 0
            start = offset or 0
            cut = size - start > max_bytes
            if cut:
                start = size - max_bytes
            f.seek(start)
            data = f.read(size - start)
    except (FileNotFoundError, IsADirectoryError):
        return [], offset or 0
    if cut and start:  # began mid-line: skip to the next whole one
        first = data.find(b"\n") + 1
        data, start = data[first:], start + first
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), start + end


def tail_jsonl(path: Path, max_bytes: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of the last ``max_bytes`` of a file, and the offset after them."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return [], 0
    if start:
        first = data.find(b"\n") + 1
        data, start = data[first:], start + first
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            obj = strict_json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out, start + end
