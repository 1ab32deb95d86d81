"""Numbers, sizes and durations as the consoles print them (headless, ``status``, the TUI),
and a Rich console for command output that never cuts a line."""

from __future__ import annotations

import math
from typing import Any

# Off a terminal, tables render at their natural width: a pipe or a log file has no edge.
UNLIMITED_WIDTH = 100_000


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt(x: float | None, spec: str = ".4f") -> str:
    """A loss or metric (headless lines, summary, ``ls``): four decimals while they carry its
    meaning (|x| >= 0.01), else four significant digits (``0.001234``, ``1.234e-05``), so a
    small loss never prints as 0. Another ``spec`` is used as it is."""
    if x is None:
        return "-"
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return str(x)  # a field a task put beside its metrics: shown, never a traceback
    small = isinstance(x, float) and math.isfinite(x) and x != 0 and abs(x) < 0.01
    return format(x, ".4g" if spec == ".4f" and small else spec)


def uncut(console: Any) -> Any:
    """``console`` made safe for copying off a terminal (a pipe, CI, nohup, ``| tee``): lines
    are never wrapped and tables take their natural width, so a path stays one string. On a
    terminal it is left as it is (tables wrap what does not fit; see their columns)."""
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = UNLIMITED_WIDTH
    return console


def eval_progress_text(p: dict[str, Any] | None) -> str:
    """``eval 120/400`` (rank 0's batches) for the eval in progress, else empty."""
    if not p:
        return ""
    split = f" {p['split']}" if p.get("split") else ""
    return f"eval{split} {p.get('done')}/{p.get('total')}"


def optimizer_line(o: dict[str, Any]) -> str:
    """``optimizer main: AdamW (fused), 2 groups, lr 0.003, schedule cosine``."""
    groups = o.get("param_groups") or []
    lrs = sorted({g["lr"] for g in groups})
    lr = ", lr " + "/".join(f"{x:.3g}" for x in lrs) if lrs else ""
    sched = o.get("schedule") or {}
    on = f" on eval {sched['monitor']}" if sched.get("monitor") else ""
    return (
        f"optimizer {o.get('name')}: {o.get('class')} ({o.get('impl')}), "
        f"{len(groups)} group{'s' if len(groups) != 1 else ''}{lr}, "
        f"schedule {sched.get('kind', 'none')}{on}"
    )


def compiling_text(since: float | None, now: float) -> str:
    """``compiling 42 s``: train.compile's first step, with how long it has taken so far."""
    if not isinstance(since, (int, float)):
        return "compiling"
    return f"compiling {max(0.0, now - since):.0f} s"


def strategy_text(start: dict[str, Any]) -> str:
    """How the model is spread over the ranks, from the start event: ``ddp``, ``single
    device`` (ddp on one rank), or ``fsdp (2
    blocks + root)`` / ``fsdp (root only)`` with its offload (engine/fsdp.py)."""
    if start.get("strategy") == "single":
        return "single device (one rank: no DDP)"
    if start.get("strategy") == "expert":
        n = (start.get("expert_parallel") or {}).get("parameters")
        own = f"{n} expert tensors on their own rank" if isinstance(n, int) else "experts spread"
        return f"expert ({own}, the rest ddp)"
    if start.get("strategy") != "fsdp":
        return start.get("strategy") or "ddp"
    f = start.get("fsdp") or {}
    n = f.get("sharded_blocks") or 0
    units = f"{n} block{'s' if n != 1 else ''} + root" if n else "root only"
    offload = ", cpu offload" if f.get("cpu_offload") else ""
    kept = ", kept gathered after forward" if f.get("reshard_after_forward") is False else ""
    return f"fsdp ({units}{offload}{kept})"


def steps_text(step: int | None, max_steps: int | None, commas: bool = False) -> str:
    """``step/max_steps``: ``-`` where the length is not known, ``∞`` for a run until
    stopped (``train.max_steps = 0``)."""
    n = step or 0
    done = f"{n:,}" if commas else str(n)
    if not isinstance(max_steps, int) or isinstance(max_steps, bool):
        return f"{done}/-"
    if max_steps == 0:
        return f"{done}/∞"
    return f"{done}/{max_steps:,}" if commas else f"{done}/{max_steps}"


def early_stop_line(e: dict[str, Any]) -> str:
    """An ``early_stop`` event (engine/early_stop.py) as headless and the run screen's log say
    it: how many evals since the best, of the patience."""
    since, patience = e.get("evals_since_best"), e.get("patience")
    best = f"best {fmt(e.get('best'))} at step {e.get('best_step')}"
    if e.get("stop"):
        return f"early stopping @ step {e.get('step')}: {since} evals without improvement ({best})"
    if not since:
        return f"early stopping: {e.get('metric')} improved ({best})"
    return f"early stopping: {since}/{patience} evals without improvement ({best})"
