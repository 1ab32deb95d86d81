"""The run's checkpoints as they are on disk, newest first: step, reason, size, age.

What ``checkpoint.keep_last`` pruned is gone from the list; ``▶`` marks the one
``checkpoints/LATEST`` names (what ``--resume`` continues from), ``★`` the one
``checkpoints/BEST`` names (``checkpoint.keep_best``: what ``export --best`` writes out).
The legend is the panel's subtitle: a title that carried it was cut at every width but the
widest. A narrow panel leaves the size out before the step, reason and age.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.events import Resize

from .panel import TextPanel
from .text import ago, human_bytes

TITLE = "checkpoints on disk"
LEGEND = "▶ LATEST  ★ BEST"
# Content columns of a row with its size: marks 2, step 8, reason 9, size 11, age up to 6.
WITH_SIZE = 36


def checkpoints_text(
    checkpoints: list[dict[str, Any]], now: float, rows: int = 50, width: int | None = None
) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if not checkpoints:
        t.append("none on disk", style="dim")
        return t
    sizes = width is None or width >= WITH_SIZE
    for i, c in enumerate(reversed(checkpoints[-rows:])):
        if i:
            t.append("\n")
        style = "bold" if c.get("reason") in ("request", "stop") else ""
        t.append("▶" if c.get("latest") else " ", style="bold #5fd787")
        t.append("★" if c.get("best") else " ", style="bold #ffd75f")
        t.append(f"{c.get('step', 0):>7,} ", style="bold")
        t.append(f"{str(c.get('reason') or ''):<8} ", style=style)
        if sizes:
            t.append(f"{human_bytes(c.get('bytes')):>10} ", style="dim")
        t.append(ago(now - c["t"]) if isinstance(c.get("t"), (int, float)) else "-", style="dim")
    return t


def newest_line(checkpoints: list[dict[str, Any]], now: float) -> str:
    """The LATEST and BEST checkpoints in a few words, where the panel gave way (``""``:
    none on disk)."""
    latest = next((c for c in reversed(checkpoints) if c.get("latest")), None)
    latest = latest or (checkpoints[-1] if checkpoints else None)
    if latest is None:
        return ""
    text = f"▶ ckpt {latest.get('step', 0):,}"
    if isinstance(latest.get("t"), (int, float)):
        text += f" {ago(now - latest['t'])}"
    best = next((c for c in checkpoints if c.get("best")), None)
    if best is not None and best is not latest:
        text += f"  ★ {best.get('step', 0):,}"
    return text


class CheckpointList(TextPanel):
    _data: tuple[list[dict[str, Any]], float] | None = None

    def show(self, checkpoints: list[dict[str, Any]], now: float) -> None:
        self._data = (checkpoints, now)
        self.show_text(checkpoints_text(checkpoints, now, width=self.size.width or None))

    def on_resize(self, event: Resize) -> None:
        if self._data is not None:  # the columns that fit have changed
            self.show(*self._data)
