"""The run screen's header: who, where, how far, how fast, and the last command's answer."""

from __future__ import annotations

from rich.text import Text

from ...format import compiling_text, eval_progress_text
from ..feed import RunSnapshot
from .panel import TextPanel
from .text import STATE_STYLE, human_duration, num


def header_text(s: RunSnapshot, command: Text | None = None, readonly: bool = False) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(s.name, style="bold")
    t.append("  ")
    t.append(f" {s.state} ", style=STATE_STYLE.get(s.state, "bold") + " reverse")
    if s.state == "compiling":  # train.compile's first step: how long so far
        t.append(" " + compiling_text(s.compiling_since, s.now).removeprefix("compiling "))
    if s.startup:  # launch to first step: which stage (startup.py)
        t.append(f" {s.startup}", style=STATE_STYLE["starting"].replace("bold ", ""))
    if s.state in ("stalled", "lost", "stopping", "restarting") and s.reason:
        t.append(f" {s.reason}", style=STATE_STYLE.get(s.state, ""))
    if readonly:
        t.append(" read-only", style="dim")
    t.append("  step ")
    t.append(f"{s.step:,}", style="bold")
    if s.max_steps:
        t.append(f"/{s.max_steps:,} ({100 * s.step / s.max_steps:.0f}%)")
    elif s.max_steps == 0:  # train.max_steps = 0
        t.append(" (until stopped)", style="dim")
    if s.eval_progress:
        t.append(f"  {eval_progress_text(s.eval_progress)}", style="bold #d7af5f")
    t.append(f"  elapsed {human_duration(s.elapsed_s)}")
    if s.restarts:
        t.append(f"  restarts {s.restarts}", style="#ffaf5f")
    if s.eta_s is not None:
        t.append(f"  ETA {human_duration(s.eta_s)}")
    t.append("\n")
    where = f"{s.world_size or '-'}× {s.device_type or '-'}"
    t.append(f"{s.precision or '-'} · {where}", style="dim")
    if s.strategy:
        t.append(f" · {s.strategy}", style="dim")
    if s.task:
        t.append(f" · {s.task}", style="dim")
    t.append("  loss ")
    t.append(num(s.loss), style="bold #5fafff")
    if s.best_loss is not None:
        t.append(f" (best {num(s.best_loss)})", style="dim")
    if s.skipped:  # nan_policy = "skip": updates not made
        t.append(f"  skipped {s.skipped:,}", style="#ffaf5f")
    if s.tokens_per_s:
        t.append(f"  {s.tokens_per_s:,.0f} tok/s")
    if s.samples_per_s:
        t.append(f"  {s.samples_per_s:,.0f} samples/s")
    if s.mfu is not None:
        t.append(f"  MFU {s.mfu:.1%}")
    elif s.mfu_not_shown and s.device_type == "cuda":
        t.append("  MFU -", style="dim")  # an unknown GPU: the summary says why
    if command is not None:
        t.append("  ")
        t.append_text(command)
    return t


class RunHeader(TextPanel):
    def show(self, s: RunSnapshot, command: Text | None = None, readonly: bool = False) -> None:
        self.show_text(header_text(s, command, readonly))
