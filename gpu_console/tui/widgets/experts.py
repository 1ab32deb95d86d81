"""A mixture of experts' routing at the newest log step: each expert's share of the tokens.

A task reports it as train metrics named ``expert_load/<i>`` (the built-in ``moe`` does);
the run screen shows this panel only for a run that does. Each bar is blue up to the even
share (1/experts) and orange past it: a collapsing router shows as a few orange bars and
empty ones. ``dropped`` (the share past capacity) and ``aux_loss`` head the panel when the
task reports them.
"""

from __future__ import annotations

import re

from rich.text import Text

from .panel import TextPanel
from .text import num

PREFIX = "expert_load/"
BAR = 12  # cells of a bar at twice the even share
_INDEX = re.compile(r"expert_load/(\d+)$")


def expert_loads(metrics: dict[str, float]) -> list[tuple[int, float]]:
    """The reported shares, by expert index (non-numbers left out)."""
    loads = []
    for name, value in metrics.items():
        m = _INDEX.match(name)
        if m and isinstance(value, (int, float)):
            loads.append((int(m.group(1)), float(value)))
    return sorted(loads)


def experts_text(metrics: dict[str, float]) -> Text:
    loads = expert_loads(metrics)
    t = Text(no_wrap=True, overflow="ellipsis")
    if not loads:
        t.append("no routing reported yet", style="dim")
        return t
    head = [f"{k} {num(metrics[k])}" for k in ("dropped", "aux_loss") if k in metrics]
    if head:
        t.append("  ".join(head) + "\n", style="dim")
    even = 1 / len(loads)
    for row, (i, share) in enumerate(loads):
        if row:
            t.append("\n")
        cells = min(BAR, round(share / even * BAR / 2))
        t.append(f"e{i:<3}", style="bold")
        t.append("█" * min(cells, BAR // 2), style="#5fafff")
        t.append("█" * max(0, cells - BAR // 2), style="#ffaf5f")  # over the even share
        t.append(" " * (BAR - cells))
        t.append(f" {share:6.1%}")
    return t


class ExpertPanel(TextPanel):
    def show(self, metrics: dict[str, float]) -> None:
        self.show_text(experts_text(metrics))
