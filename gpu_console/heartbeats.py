"""The ranks' heartbeat files, read by the console (``engine/heartbeat.py`` writes them).

No torch here: ``ls``, ``status``, ``stop`` and every console read them to tell a frozen
rank from a slow one.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import psutil

# The file's contract, shared with its writer (engine/heartbeat.py imports it from here).
DIR = "heartbeats"
# Order of the phases within one step: a rank in an earlier phase is behind.
PHASES = (
    "starting",
    "data",
    "compute",
    "update",
    "sync",
    "eval",
    "checkpoint",
    "control",
    "paused",
)
ENDED = ("done", "failed")


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's heartbeat record on this node, by rank (unreadable ones skipped)."""
    beats: list[dict[str, Any]] = []
    folder = Path(run_dir) / DIR
    try:
        paths = sorted(folder.glob("rank-*.json"))
    except OSError:
        return beats
    for path in paths:
        for _ in range(3):  # rewritten in place: a read may catch a write half-way
            try:
                beats.append(json.loads(path.read_bytes().strip() or b"null"))
                break
            except (OSError, ValueError):
                continue
    return [b for b in beats if isinstance(b, dict) and isinstance(b.get("rank"), int)]


def pid_alive(pid: int | None) -> bool:
    """A live process with this pid on this machine (a stopped one is; a zombie is not: where
    no init reaps orphans, as in many containers, a dead process stays a zombie for good).
    The one liveness rule of the console: runs' states, lost records and heartbeats."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:
        return True  # another user's process: it exists
    except psutil.Error:
        return False


def elsewhere(status: dict[str, Any]) -> bool:
    """The session ran on another machine (a runs directory on a shared file system, read
    from a login node): its pids mean nothing here."""
    host = status.get("host")
    return isinstance(host, str) and bool(host) and host != socket.gethostname()


def _alive_here(beat: dict[str, Any]) -> bool:
    """The rank's process exists (a stopped one does). A rank on another host: assumed so."""
    if beat.get("host") not in (None, socket.gethostname()):
        return True
    return pid_alive(beat.get("pid"))


def all_beating(run_dir: Path, now: float, within_s: float) -> bool:
    """Every live rank's process is there and its heartbeat wrote within ``within_s`` (and
    there is one): the run's processes are all moving, none frozen or killed."""
    live = [b for b in read_heartbeats(run_dir) if b.get("phase") not in ENDED]
    return bool(live) and all(
        now - float(b.get("t") or 0) <= within_s and _alive_here(b) for b in live
    )


def frozen_ranks(
    run_dir: Path, now: float, limit_s: float, since: float | None = None
) -> list[dict[str, Any]]:
    """The ranks whose process lives but whose heartbeat thread has not written for
    ``limit_s``: frozen (SIGSTOP, a dead mount, a wedge holding the interpreter).

    The thread writes about once a second in every phase (start-up, compiling, eval, a
    checkpoint, paused), so silence is the one sign of a stall that does not depend on
    steps: it catches a rank frozen before its first step, and never flags a long phase
    whose thread still writes. A dead rank is torchrun's to report, not a stall; a record
    older than ``since`` (this session's start) is an earlier session's.
    """
    out = []
    for b in read_heartbeats(run_dir):
        t = b.get("t")
        if b.get("phase") in ENDED or not isinstance(t, (int, float)) or isinstance(t, bool):
            continue
        if since is not None and t < since:
            continue
        if now - t > limit_s and _alive_here(b):
            out.append(b)
    return out
