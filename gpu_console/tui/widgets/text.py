"""Small text helpers shared by the widgets: sparklines, bars, ages, state styles."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...format import human_bytes, human_duration

__all__ = ["human_bytes", "human_duration", "spark", "bar", "ago", "STATE_STYLE", "num"]

SPARK = "▁▂▃▄▅▆▇█"

# Fixed colours (not theme variables): pictures and snapshots stay the same; under NO_COLOR
# Textual turns them grey and every state still reads as its word.
STATE_STYLE = {
    "starting": "bold #5fd7ff",
    "running": "bold #5fd75f",
    "compiling": "bold #5fd7ff",
    "paused": "bold #ffd75f",
    "stopping": "bold #ffaf5f",
    "finished": "bold #87afff",
    "stopped": "bold #ffd75f",
    "requeued": "bold #ffd75f",
    "failed": "bold #ff5f5f",
    "refused": "bold #ff5f5f",
    "interrupted": "bold #ffaf5f",
    "killed": "bold #ffaf5f",
    "lost": "bold #ff5f5f",
    "stalled": "bold #ff87ff",
    "restarting": "bold #ffaf5f",
}


def spark(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None):
    """The last ``width`` values as block characters, scaled to [lo, hi] (default: their range)."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)][-width:]
    if not vals or width <= 0:
        return " " * max(width, 0)
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    out = []
    for v in vals:
        level = 0 if span <= 0 else int((min(max(v, lo), hi) - lo) / span * (len(SPARK) - 1))
        out.append(SPARK[level])
    return "".join(out).rjust(width)


def bar(frac: float | None, width: int) -> str:
    if frac is None or width <= 0:
        return "·" * max(width, 0)
    filled = round(max(0.0, min(1.0, frac)) * width)
    return "█" * filled + "░" * (width - filled)


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m ago"
    return f"{s // 86400}d ago"


def num(x: float | None, digits: int = 4) -> str:
    """A number for a label: ``1,234``, ``0.5951``, ``3e-04``; never wider than it must be."""
    if x is None or not isinstance(x, (int, float)):
        return "-"
    if not math.isfinite(x):
        return str(x)
    ax = abs(x)
    if ax >= 1e9 or (ax != 0 and ax < 1e-3):
        return f"{x:.{max(0, digits - 2)}e}"
    if ax >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"
