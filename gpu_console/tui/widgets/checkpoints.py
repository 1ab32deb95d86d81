"""The run's checkpoints as they are on disk, newest first: step, reason, size, age.

What ``checkpoint.keep_last`` pruned is gone from the list; ``▶`` marks the one
``checkpoints/LATEST`` names (what ``--resume`` continues from), ``★`` the one
``checkpoints/BEST`` names (``checkpoint.keep_best``: what ``export --best`` writes out).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from .panel import TextPanel
from .text import ago, human_bytes

TITLE = "checkpoints on disk (▶ LATEST ★ BEST)"


def checkpoints_text(checkpoints: list[dict[str, Any]], now: float, rows: int = 50) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if not checkpoints:
        t.append("none on disk", style="dim")
        return t
    for i, c in enumerate(reversed(checkpoints[-rows:])):
        if i:
            t.append("\n")
        style = "bold" if c.get("reason") in ("request", "stop") else ""
        t.append("▶" if c.get("latest") else " ", style="bold #5fd787")
        t.append("★" if c.get("best") else " ", style="bold #ffd75f")
        t.append(f"{c.get('step', 0):>7,} ", style="bold")
        t.append(f"{str(c.get('reason') or ''):<8} ", style=style)
        t.append(f"{human_bytes(c.get('bytes')):>10} ", style="dim")
        t.append(ago(now - c["t"]) if isinstance(c.get("t"), (int, float)) else "-", style="dim")
    return t


class CheckpointList(TextPanel):
    def show(self, checkpoints: list[dict[str, Any]], now: float) -> None:
        self.show_text(checkpoints_text(checkpoints, now))
