"""``ls``, ``stop`` and ``checkpoint``: operate runs from any shell (no torch here).

Commands reach a run only through its directory: ``control.jsonl`` for requests, events
for their acknowledgement, status.json for pids. A command to an ended run is a bad input.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ..events import append_control, read_events
from ..runs import FINAL_STATES, RunDirError, find_run, read_status
from ..state import derived_state

ACK_TIMEOUT_S = 60.0


class RunEndedError(RunDirError):
    """A control command to a run that is no longer running."""


def list_runs(runs_dir: Path) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    if not Path(runs_dir).is_dir():
        return rows
    for run in sorted(Path(runs_dir).iterdir()):
        if not (run / "run.toml").is_file():
            continue
        status = read_status(run)
        started = status.get("started") or run.stat().st_mtime
        last = status.get("ended") or status.get("last_step_t") or started
        rows.append(
            {
                "name": run.name,
                "path": str(run),
                "state": derived_state(status, now),
                "reason": status.get("reason", ""),
                "step": status.get("step"),
                "max_steps": status.get("max_steps"),
                "loss": status.get("loss"),
                "started": started,
                "age_s": round(now - last, 1),
            }
        )
    rows.sort(key=lambda r: r["started"], reverse=True)
    return rows


def _live(run: Path) -> dict[str, Any]:
    status = read_status(run)
    state = derived_state(status, time.time())
    if state in FINAL_STATES or state == "lost":
        raise RunEndedError(f"{run}: the run has already ended (state {state})")
    return status


def request(run_arg: str, runs_dir: Path, cmd: str, wait_s: float = ACK_TIMEOUT_S):
    """Append ``cmd`` and wait for the engine's acknowledgement; return (run, ack events)."""
    run = find_run(run_arg, runs_dir)
    _live(run)
    cid = append_control(run, cmd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        acks = [e for e in read_events(run / "events.jsonl") if e.get("id") == cid]
        if any(a.get("state") in ("done", "rejected") for a in acks):
            return run, cid, acks
        if derived_state(read_status(run), time.time()) in (*FINAL_STATES, "lost"):
            return run, cid, acks
        time.sleep(0.1)
    return run, cid, []


def stop_now(run_arg: str, runs_dir: Path) -> Path:
    """Terminate the run's processes now (the supervisor records the end)."""
    run = find_run(run_arg, runs_dir)
    status = _live(run)
    pids = status.get("pids", {})
    try:
        os.kill(pids["supervisor"], signal.SIGINT)
    except (KeyError, ProcessLookupError):
        for pid in [pids.get("torchrun"), *(pids.get("workers") or [])]:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return run


def checkpoint_after(run: Path, cid: str) -> dict[str, Any] | None:
    """The checkpoint event written for request ``cid`` (it follows the 'received' ack)."""
    seen = False
    for e in read_events(run / "events.jsonl"):
        if e.get("kind") == "control" and e.get("id") == cid:
            seen = True
        elif seen and e.get("kind") == "checkpoint":
            return e
    return None


def to_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=2)
