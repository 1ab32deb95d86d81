"""On failure: which rank, its exit code, and its traceback (status.json ``failure``)."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from .panel import TextPanel


def failure_text(failure: dict[str, Any], reason: str = "") -> Text:
    t = Text()
    rank = failure.get("rank")
    code = failure.get("exit_code")
    t.append("✖ FAILED", style="bold #ff5f5f")
    t.append(f"  rank {rank if rank is not None else '?'}", style="bold")
    t.append(f"  exit code {code if code is not None else '?'}\n", style="bold")
    t.append(str(failure.get("summary") or reason or "no summary"), style="#ff5f5f")
    tb = str(failure.get("traceback") or "").rstrip()
    if tb:
        t.append("\n\n")
        t.append(tb, style="")
    else:
        t.append("\n\n(no traceback recorded: see logs/ in the run directory)", style="dim")
    return t


class FailurePanel(TextPanel):
    def show(self, failure: dict[str, Any], reason: str = "") -> None:
        self.show_text(failure_text(failure, reason))
