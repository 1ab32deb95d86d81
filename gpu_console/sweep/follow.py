"""The headless sweep console: a line per trial event, the final table, the exit code.

Ctrl-C once asks the driver to stop the sweep (its running trials stop with a checkpoint;
``gpu-console sweep --resume`` continues them); twice leaves the console, the sweep going on
stopping. A closed terminal changes nothing for the sweep. No torch.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..events import JsonlTail
from . import store

POLL_S = 0.2


def params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={value_text(v)}" for k, v in params.items())


def value_text(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def event_line(e: dict[str, Any], plan: dict[str, Any], best: float | None) -> str | None:
    """The console's line for one event (None: nothing to say)."""
    metric = plan["objective"]["metric"]
    if e.get("kind") == "sweep":
        state = e.get("state")
        if state == "running":
            return "sweep driver resumed" if e.get("resumed") else None
        return f"sweep {state}: {e.get('reason', '')}".rstrip(": ")
    if e.get("kind") != "trial":
        return None
    n, state = e.get("trial"), e.get("state")
    params = params_text(_ordered(plan, n)) if n is not None else ""
    if state == "started":
        return f"trial {n} started on {e.get('devices')}: {params}  ({e.get('run')})"
    if state == "resumed":
        where = f"on {e.get('devices')}  ({e.get('run')})"
        return f"trial {n} resumed from step {e.get('step')} {where}"
    if state == "adopted":
        return f"trial {n} still running on {e.get('devices')}  ({e.get('run')})"
    if state == "finished":
        value = e.get("objective")
        if value is None:
            return f"trial {n} finished: {e.get('reason')}"
        mark = "  (best so far)" if best is not None and value == best else ""
        return f"trial {n} finished: {metric} = {value:.6g}{mark}"
    if state == "stopped":
        return f"trial {n} stopped at step {e.get('step')} (its checkpoint: --resume continues it)"
    if state == "failed":
        return f"trial {n} failed: {e.get('reason')}"
    if state == "pruned":
        return f"trial {n} pruned at step {e.get('step')}: {e.get('reason')}"
    return None


def _ordered(plan: dict[str, Any], n: int) -> dict[str, Any]:
    """Trial ``n``'s values in the sweep file's order of its parameters."""
    values = plan["trials"][n]["params"]
    return {k: values[k] for k in plan["sweep"]["parameters"] if k in values}


def table(sweep_dir: Path, plan: dict[str, Any]) -> str:
    """Every trial: its number, state, values, objective; the best marked ``*``."""
    folded = store.fold(store.read_events(sweep_dir), plan)
    keys = list(plan["sweep"]["parameters"])
    metric = plan["objective"]["metric"]
    head = ["trial", "state", *keys, metric, "run"]
    best = folded["best"]
    rows = []
    for r in folded["trials"]:
        value = r["objective"]
        star = "*" if best is not None and r["trial"] == best["trial"] else " "
        rows.append([
            f"{star}{r['trial']}", r["state"], *(value_text(r["params"][k]) for k in keys),
            "" if value is None else f"{value:.6g}", r["run"] or "",
        ])  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
             for row in [head, *rows]]  # fmt: skip
    if best is not None:
        lines.append(f"best: trial {best['trial']}, {metric} = {best['objective']:.6g}  "
                     f"({sweep_dir / best['run']})")  # fmt: skip
    return "\n".join(lines)


def follow(sweep_dir: Path, driver_alive: Callable[[], bool], offset: int = 0, print_=print) -> int:
    """Report the sweep until its driver ends it: 0 when it finished or stopped as asked,
    1 when its driver failed or vanished, 130 when the console left on a second Ctrl-C.
    ``offset``: where this driver's events begin (a resumed sweep's earlier ones are told)."""
    plan = store.read_plan(sweep_dir)
    tail = JsonlTail(sweep_dir / store.EVENTS, offset)
    interrupts = [0]

    def on_sigint(_signum, _frame) -> None:
        interrupts[0] += 1
        if interrupts[0] == 1:
            store.append_control(sweep_dir, "stop")
            print_("stopping the sweep: its running trials checkpoint and stop "
                   f"(gpu-console sweep --resume {sweep_dir} continues); Ctrl-C again leaves "
                   "this console")  # fmt: skip

    previous = signal.signal(signal.SIGINT, on_sigint)
    best: float | None = None
    if offset:  # the best of the sweep's earlier drivers
        earlier = store.fold(JsonlTail(sweep_dir / store.EVENTS).read(offset), plan)["best"]
        best = earlier["objective"] if earlier else None
    direction = plan["objective"]["direction"]
    try:
        while True:
            if interrupts[0] >= 2:
                print_(f"left the console; the sweep goes on stopping ({sweep_dir})")
                return 130
            for e in tail.read():
                if e.get("trial", -1) >= len(plan["trials"]):
                    plan = store.read_plan(sweep_dir)  # a tpe trial its driver just chose
                value = e.get("objective") if e.get("state") == "finished" else None
                if isinstance(value, (int, float)) and (
                    best is None or store.better(direction, value, best)
                ):
                    best = value
                line = event_line(e, plan, best)
                if line:
                    print_(line)
                if e.get("kind") == "sweep" and e.get("state") in store.ENDED:
                    print_(table(sweep_dir, store.read_plan(sweep_dir)))
                    return 1 if e["state"] == "failed" else 0
            if not driver_alive() and not _ended(sweep_dir, offset):
                print_(f"the sweep's driver exited without ending the sweep (see "
                       f"{sweep_dir / store.LOG}); gpu-console sweep --resume {sweep_dir} "
                       "continues it")  # fmt: skip
                return 1
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ended(sweep_dir: Path, offset: int) -> bool:
    return any(
        e.get("kind") == "sweep" and e.get("state") in store.ENDED
        for e in JsonlTail(sweep_dir / store.EVENTS, offset).read()
    )
