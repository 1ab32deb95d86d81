"""Which runs ``ls`` lists, and in what order: ``--state``, ``--since``, ``--profile``,
``--sort`` (no torch here). A bad value is bad input: one line, exit 2."""

from __future__ import annotations

import fnmatch
import math
import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..runs import FINAL_STATES, RunDirError

# Every state a row of ``ls`` can show (the engine's, the supervisor's end, and the two a
# reader derives: stalled, lost), and two groups of them.
STATES = (
    "starting", "compiling", "running", "paused", "stopping", "stalled", "lost",
    "finished", "stopped", "requeued", "failed", "refused", "interrupted", "killed",
)  # fmt: skip
ENDED = {*FINAL_STATES, "lost"}
GROUPS = {"live": {s for s in STATES if s not in ENDED}, "ended": ENDED}

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")


def _newest(key: str) -> tuple[Callable[[dict], Any], bool]:
    return (lambda r: r[key] or 0.0), True


def _lowest(key: str) -> tuple[Callable[[dict], Any], bool]:
    # A run without the figure (no step yet, a NaN) goes last.
    def value(r: dict) -> float:
        v = r.get(key)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else math.inf

    return value, False


SORTS: dict[str, tuple[Callable[[dict], Any], bool]] = {
    "started": _newest("started"),  # the run's first start, newest first
    "updated": _newest("updated"),
    "name": ((lambda r: r["name"]), False),
    "state": ((lambda r: r["state"]), False),
    "step": ((lambda r: r["step"] or 0), True),  # furthest first
    "loss": _lowest("loss"),  # lowest first
    "best_loss": _lowest("best_loss"),
}


class SelectError(RunDirError):
    """A filter or sort ``ls`` cannot use (bad input, exit 2)."""


def parse_states(values: list[str]) -> set[str] | None:
    """``--state failed --state lost`` or ``--state failed,lost``; ``live``/``ended`` stand
    for their states. None: every state."""
    wanted: set[str] = set()
    for value in values:
        for name in (v.strip() for v in value.split(",")):
            if name in GROUPS:
                wanted |= GROUPS[name]
            elif name in STATES:
                wanted.add(name)
            else:
                known = ", ".join([*STATES, *GROUPS])
                raise SelectError(f"--state: one of {known} (got {name!r})")
    return wanted or None


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a time ago (``90m``, ``2h``, ``3d``, ``1w``, ``45s``) or a local date and
    time (``2026-11-25``, ``2026-11-25T14:30``, ``2026-11-25 14:30:00``): epoch seconds."""
    now = time.time() if now is None else now
    text = text.strip()
    if m := _AGO.fullmatch(text):
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise SelectError(
            "--since: a time ago like 90m, 2h, 3d or 1w, or a date like 2026-11-25 or "
            f"2026-11-25T14:30 (got {text!r})"
        ) from None


def select(
    rows: list[dict[str, Any]],
    states: set[str] | None = None,
    since: float | None = None,
    profile: str | None = None,
) -> list[dict[str, Any]]:
    """The rows that pass every filter given: state, started at or after ``since``, and a
    profile name (or the run's own name, or its directory's) matching ``profile`` (a shell
    pattern: ``cvrp*``)."""
    out = []
    for r in rows:
        if states is not None and r["state"] not in states:
            continue
        if since is not None and (r["started"] or 0.0) < since:
            continue
        if profile is not None:
            names = (r.get("profile") or "", r.get("run_name") or "", r["name"])
            if not any(fnmatch.fnmatchcase(n, profile) for n in names):
                continue
        out.append(r)
    return out


def sort_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    if key not in SORTS:
        raise SelectError(f"--sort: one of {', '.join(SORTS)} (got {key!r})")
    value, newest_first = SORTS[key]
    return sorted(rows, key=value, reverse=newest_first)
