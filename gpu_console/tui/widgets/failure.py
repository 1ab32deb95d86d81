"""On failure: who failed (a rank, torchrun, the supervisor), its exit code, and why.

From status.json's ``failure``: a rank's traceback, or the one line torchrun or the supervisor
failed with (a flag torchrun rejects, a rendezvous error, a process that cannot start).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from .panel import TextPanel

# Where the one who failed wrote what it had to say.
LOGS = {"torchrun": "logs/torchrun.log", "supervisor": "logs/supervisor.log"}


def failure_text(failure: dict[str, Any], reason: str = "") -> Text:
    t = Text()
    rank = failure.get("rank")
    code = failure.get("exit_code")
    t.append("✖ FAILED", style="bold #ff5f5f")
    source = failure.get("source") or ("rank" if rank is not None else "torchrun")
    t.append(f"  rank {rank}" if rank is not None else f"  {source}", style="bold")
    t.append(f"  exit code {code if code is not None else '?'}\n", style="bold")
    t.append(str(failure.get("summary") or reason or "no summary"), style="#ff5f5f")
    tb = str(failure.get("traceback") or "").rstrip()
    if tb:
        t.append("\n\n")
        t.append(tb, style="")
    else:
        log = LOGS.get(source, "logs/")
        t.append(f"\n\n(no traceback recorded: see {log} in the run directory)", style="dim")
    return t


class FailurePanel(TextPanel):
    def show(self, failure: dict[str, Any], reason: str = "") -> None:
        self.show_text(failure_text(failure, reason))
