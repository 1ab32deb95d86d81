"""A sweep's directory: the contract between its driver and every console.

::

    runs/<name>-<YYYYmmdd-HHMMSS>/
      sweep.toml      the sweep file as given
      sweep.json      the plan: the resolved sweep, every trial's values and --sets, the slots
      sweep.jsonl     the driver's events (one writer): sweep states and trial starts/ends
      control.jsonl   console → driver commands (stop)
      driver.log      the driver's own output
      .lock           one driver at a time (session_lock's kind of lock)
      trial-000/ …    each trial an ordinary run directory

No torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..events import JsonlTail, append_command, append_line
from ..events import read_events as read_run_events
from ..runs import RunDirError, atomic_write_json, read_json, run_dir_name

PLAN = "sweep.json"
EVENTS = "sweep.jsonl"
CONTROL = "control.jsonl"
LOG = "driver.log"
FILE = "sweep.toml"
ENDED = ("finished", "stopped", "failed")  # a sweep's end states (its last ``sweep`` event)
TRIAL_ENDS = ("finished", "stopped", "failed", "pruned")


def create(runs_dir: Path, name: str) -> Path:
    """``runs_dir/<name>-<stamp>`` (0700), new."""
    runs_dir = Path(runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{runs_dir}: cannot create the runs directory ({e.strerror})") from None
    base = run_dir_name(name)
    for n in range(1, 1000):
        path = runs_dir / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as e:
            why = e.strerror
            raise RunDirError(f"{runs_dir}: cannot create a sweep directory ({why})") from None
        return path
    raise RunDirError(f"{runs_dir}: too many sweeps named {base}")


def is_sweep(path: Path) -> bool:
    return (Path(path) / PLAN).is_file()


def find_sweep(arg: str, runs_dir: Path) -> Path:
    """A sweep directory, or a sweep's name under the runs directory (its newest)."""
    path = Path(arg).expanduser()
    if is_sweep(path):
        return path
    if "/" not in arg and is_sweep(runs_dir / arg):
        return runs_dir / arg
    if runs_dir.is_dir() and "/" not in arg:
        named = sorted(
            p for p in runs_dir.iterdir() if p.name.startswith(f"{arg}-") and is_sweep(p)
        )
        if named:
            return named[-1]
    raise RunDirError(f"{arg}: not a sweep directory, nor a sweep's name under {runs_dir}")


def sweep_or_none(arg: str, runs_dir: Path) -> Path | None:
    """:func:`find_sweep`'s sweep, or None where ``arg`` names none (a run, maybe)."""
    try:
        return find_sweep(arg, runs_dir)
    except RunDirError:
        return None


def trial_name(n: int) -> str:
    return f"trial-{n:03d}"


def write_plan(sweep_dir: Path, plan: dict[str, Any]) -> None:
    atomic_write_json(Path(sweep_dir) / PLAN, plan)


def read_plan(sweep_dir: Path) -> dict[str, Any]:
    plan = read_json(Path(sweep_dir) / PLAN)
    if not plan or "trials" not in plan:
        raise RunDirError(f"{Path(sweep_dir) / PLAN}: missing or damaged")
    return plan


def append_event(sweep_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """One event, appended whole (a single write of one line): the driver's alone."""
    event = {"v": 1, "t": round(time.time(), 3), "kind": kind, **fields}
    append_line(Path(sweep_dir) / EVENTS, event)
    return event


def read_events(sweep_dir: Path) -> list[dict[str, Any]]:
    return JsonlTail(Path(sweep_dir) / EVENTS).read()


COMMANDS = ("stop", "stop_trial", "prune")  # the sweep; a trial (resumable); a trial (ended)


def append_control(sweep_dir: Path, cmd: str, **args: Any) -> str:
    """One command to the sweep's driver: ``stop`` (the sweep), ``stop_trial`` or ``prune``
    (``trial=N``)."""
    if cmd not in COMMANDS:
        raise ValueError(f"unknown sweep command {cmd!r}")
    return append_command(Path(sweep_dir) / CONTROL, cmd, **args)


def fold(events: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """The sweep as its events leave it: its state, each trial's row, the best trial."""
    rows: dict[int, dict[str, Any]] = {
        t["trial"]: {
            "trial": t["trial"],
            "state": "pending",
            "params": t["params"],
            "run": None,
            "devices": None,
            "objective": None,
            "reason": "",
            "sessions": 0,
        }  # fmt: skip
        for t in plan["trials"]
    }
    state, reason = "starting", ""
    for e in events:
        if e.get("kind") == "sweep":
            state, reason = e.get("state", state), e.get("reason", "")
        elif e.get("kind") == "trial" and e.get("trial") in rows:
            row = rows[e["trial"]]
            row["state"] = e.get("state", row["state"])
            for key in ("run", "devices", "objective", "reason", "step"):
                if key in e:
                    row[key] = e[key]
            if e.get("state") in ("started", "resumed", "adopted"):
                row["state"] = "running"
                row["sessions"] += e.get("state") != "adopted"
    objective = plan["objective"]
    done = [r for r in rows.values() if r["objective"] is not None]
    best = None
    for r in done:
        if best is None or better(objective["direction"], r["objective"], best["objective"]):
            best = r
    return {"state": state, "reason": reason, "trials": [rows[k] for k in sorted(rows)],
            "best": best}  # fmt: skip


def better(direction: str, a: float, b: float) -> bool:
    """Whether objective value ``a`` beats ``b`` (``direction``: min or max)."""
    return a < b if direction == "min" else a > b


# -- a trial's objective, from its run's eval events ----------------------------------------


def eval_curve(run: Path, spec: dict[str, Any]) -> dict[int, float]:
    """A run's objective at each eval step: its value, or (``use = "best"``) its best so far."""
    curve: dict[int, float] = {}
    for e in read_run_events(run / "events.jsonl"):
        add_eval(curve, e, spec)
    return curve


def add_eval(curve: dict[int, float], e: dict[str, Any], spec: dict[str, Any]) -> None:
    """``curve`` with the eval event ``e``'s value of the objective's metric, if it has one."""
    name = spec["metric"].split(".", 1)[1]
    if e.get("kind") != "eval" or not isinstance(e.get(name), (int, float)):
        return
    value = float(e[name])
    if spec.get("use") == "best" and curve:
        so_far = curve[max(curve)]
        value = value if better(spec["direction"], value, so_far) else so_far
    curve[int(e.get("step", 0))] = value


def last(curve: dict[int, float]) -> float | None:
    """A curve's newest value: the trial's objective (its last eval's, or its best so far)."""
    return curve[max(curve)] if curve else None
