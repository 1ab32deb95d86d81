"""``profile``: trace the next K steps of a live run with torch.profiler (no torch here).

The command rides in ``control.jsonl`` with its steps; every rank captures the same steps
and writes its own trace (engine/torch_profiler.py). The engine acknowledges it ``received`` at
once and ``done`` (with the trace directory) once every rank has written, or ``rejected``
with its reason (a capture already running, a paused run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from .. import strict_json
from ..events import append_control, read_events
from ..runs import FINAL_STATES, RunDirError, find_run, read_status
from ..state import derived_state
from .runs import ACK_TIMEOUT_S, _live

MAX_STEPS = 1000  # engine/control.py's MAX_PROFILE_STEPS: the engine rejects more


class StepsError(RunDirError):
    """``--steps`` is not a whole number from 1 to MAX_STEPS (bad input, exit 2)."""


def parse_steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if not 1 <= steps <= MAX_STEPS:
        raise StepsError(f"--steps: a whole number from 1 to {MAX_STEPS} (got {text!r})")
    return steps


def request(run_arg: str, runs_dir: Path, steps: int) -> tuple[Path, str, dict[str, Any] | None]:
    """Send ``profile`` and wait for its answer: (run, command id, the last ack or None).

    The first ack must come within ACK_TIMEOUT_S; the capture's own K steps are then waited
    for as long as the run lives."""
    run = find_run(run_arg, runs_dir)
    _live(run)
    cid = append_control(run, "profile", steps=steps)
    deadline = time.monotonic() + ACK_TIMEOUT_S
    last = None
    while last is not None or time.monotonic() < deadline:
        acks = [e for e in read_events(run / "events.jsonl") if e.get("id") == cid]
        last = acks[-1] if acks else None
        if last is not None and last.get("state") in ("done", "rejected"):
            return run, cid, last
        if derived_state(read_status(run), time.time()) in (*FINAL_STATES, "lost"):
            return run, cid, last
        time.sleep(0.1)
    return run, cid, None


def traces(ack: dict[str, Any]) -> list[str]:
    """The trace files in the ack's directory (this node's ranks)."""
    folder = Path(ack.get("path") or "")
    return sorted(str(p) for p in folder.glob("*.pt.trace.json")) if folder.is_dir() else []


def main(run_arg: str, runs_dir: Path, steps_text: str, as_json: bool) -> int:
    steps = parse_steps(steps_text)
    run, cid, ack = request(run_arg, runs_dir, steps)
    state = ack.get("state") if ack else None
    if as_json:
        out = {"run": run.name, "id": cid, "state": state or "unanswered"}
        if ack:
            out.update({k: v for k, v in ack.items() if k not in ("v", "t", "kind", "id", "cmd")})
            out["state"] = state
            out["files"] = traces(ack) if state == "done" else []
        print(strict_json.dumps(out, indent=2))
    elif state == "done":
        span = f"steps {ack.get('first_step')}-{ack.get('last_step')}"
        ended = ack.get("ended_by")
        cut = "" if ended == "complete" else f", cut short by {ended}"
        print(f"{ack['path']} ({span}, {ack.get('ranks')} ranks{cut})")
    elif state == "rejected":
        print(f"{run.name}: profile rejected: {ack.get('reason')}", file=sys.stderr)
    else:
        print(f"{run.name}: profile requested; no trace yet (the run ended?)", file=sys.stderr)
    return 0 if state == "done" else 1
