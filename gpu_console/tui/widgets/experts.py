"""A mixture of experts' routing at the newest log step: each expert's share of the tokens.

A task reports it as train metrics named ``expert_load/<i>`` (the built-in ``moe`` does);
the run screen shows this panel only for a run that reports them. Every number is a percent
of the tokens: each share, and ``dropped`` (the share past capacity) where the task reports
it, with ``aux_loss`` in the panel's first row (``drop`` and ``aux`` where the row is short).
Each bar spans twice the even share (1/experts) with a ``│`` at the even share: blue up to
it, orange past it, so a collapsing router shows as a few orange bars and empty ones.

A panel too short for a row per expert puts several experts on a row with shorter bars
(eight experts in four rows at 80×24); one too short even then scrolls.
"""

from __future__ import annotations

import math
import re

from rich.text import Text
from textual.events import Resize

from .panel import TextPanel
from .text import num

PREFIX = "expert_load/"
BAR = 12  # cells of a full row's bar: twice the even share
SHORT_BAR = 4  # a compact cell's
EVEN_MARK = "│"
EIGHTHS = " ▏▎▍▌▋▊▉"  # a cell's fraction: short bars still tell 10 % from 12.5 %
_INDEX = re.compile(r"expert_load/(\d+)$")
PERCENT = 7  # " 30.0%" in a full row; " 30%" in a compact cell
GAP = 2  # between compact cells


def expert_loads(metrics: dict[str, float]) -> list[tuple[int, float]]:
    """The reported shares, by expert index (non-numbers left out)."""
    loads = []
    for name, value in metrics.items():
        m = _INDEX.match(name)
        if m and isinstance(value, (int, float)):
            loads.append((int(m.group(1)), float(value)))
    return sorted(loads)


def _cells(fill: float, cells: int) -> str:
    """``fill`` cells (clamped to ``cells``) as blocks to an eighth, padded to ``cells``."""
    whole, part = divmod(round(min(max(fill, 0.0), float(cells)) * 8), 8)
    return ("█" * whole + (EIGHTHS[part] if part else "")).ljust(cells)


def _bar(t: Text, share: float, even: float, cells: int) -> None:
    """``cells`` at twice the even share, the mark at the even share between its halves."""
    half = cells // 2
    ratio = share / even if math.isfinite(share) else 0.0
    t.append(_cells(ratio * half, half), style="#5fafff")
    t.append(EVEN_MARK, style="dim")
    t.append(_cells((ratio - 1) * half, cells - half), style="#ffaf5f")  # over the even share


def experts_text(
    metrics: dict[str, float], width: int | None = None, height: int | None = None
) -> Text:
    """The panel's text; ``width`` and ``height`` (its content's size, when known) choose a
    row per expert, or compact cells, as many to a row as fit, where that does not fit."""
    loads = expert_loads(metrics)
    t = Text(no_wrap=True, overflow="ellipsis")
    if not loads:
        t.append("no routing reported yet", style="dim")
        return t
    head = []
    if isinstance(dropped := metrics.get("dropped"), (int, float)):
        head.append(("dropped", "drop", f"{dropped:.1%}"))
    if "aux_loss" in metrics:
        head.append(("aux_loss", "aux", num(metrics["aux_loss"])))
    if head:
        line = "  ".join(f"{name} {value}" for name, _, value in head)
        if width is not None and len(line) > width:  # short names before a cut number
            line = "  ".join(f"{short} {value}" for _, short, value in head)
        t.append(line + "\n", style="dim")
    even = 1 / len(loads)
    label = len(str(loads[-1][0])) + 2  # "e7 ", "e12 "
    full = label + BAR + 1 + PERCENT
    cell = label + SHORT_BAR + 1 + 4
    rows = None if height is None else height - bool(head)
    compact = (width is not None and width < full) or (rows is not None and rows < len(loads))
    per_row = max(1, ((width or cell) + GAP) // (cell + GAP)) if compact else 1
    for at, (i, share) in enumerate(loads):
        if at:
            t.append("\n" if at % per_row == 0 else " " * GAP)
        t.append(f"e{i}".ljust(label), style="bold")
        if compact:
            _bar(t, share, even, SHORT_BAR)
            t.append(f" {share:3.0%}".rjust(4))
        else:
            _bar(t, share, even, BAR)
            t.append(f" {share:6.1%}")
    return t


def even_share_text(metrics: dict[str, float]) -> str:
    """The subtitle: what the mark in every bar stands for."""
    loads = expert_loads(metrics)
    return f"{EVEN_MARK} even share {1 / len(loads):.1%}" if loads else ""


class ExpertPanel(TextPanel):
    _metrics: dict[str, float] | None = None

    def show(self, metrics: dict[str, float]) -> None:
        self._metrics = metrics
        size = self.parent.scrollable_content_region.size if self.parent else self.size
        self.show_text(experts_text(metrics, size.width or None, size.height or None))

    def on_resize(self, event: Resize) -> None:
        if self._metrics is not None:  # the rows and columns that fit have changed
            self.show(self._metrics)
