"""What a run is doing between its launch and its first step, from its directory (no Textual).

A run is silent for its first minute or two: the supervisor starts, torchrun imports torch
and spawns the ranks, each rank imports torch, the engine and the task, the ranks meet in
the process group, and the model and data are built. Each stage leaves a mark in the run
directory, which :func:`startup_stage` reads, newest first:

==========================================  ================================================
the mark                                    the stage
==========================================  ================================================
a step event after the start event          none: the run is training
the ``start`` event                         the first step (``compiling`` says so itself)
the engine's first ``status`` event         building the model and data (and the resume)
a rank's heartbeat, phase ``starting``      ranks importing torch, then the process group
``pids.torchrun`` in status.json            torchrun importing torch, spawning the ranks
status.json                                 the supervisor starting torchrun
only meta.json                              the supervisor starting
==========================================  ================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..heartbeats import read_heartbeats

SHOWN_IN = ("starting", "running")  # other states say what they are doing themselves
MARKS = {
    "stepped": "",
    "started": "first step…",
    "building": "building the model and data",
}


def startup_stage(
    run_dir: Path, *, state: str, status: dict[str, Any], session: dict[str, Any], mark: str
) -> str:
    """The stage in a few words; ``""`` once the session stepped, or in another state.

    ``mark``: the newest of the engine's marks of this session, in file order
    (``"stepped"``, ``"started"``, ``"building"``; ``""`` before its engine spoke).
    """
    if state not in SHOWN_IN or status.get("ended") or not session:
        return ""  # (no meta.json: not a run this console launched or can tell about)
    if mark in MARKS:
        resuming = mark == "building" and session.get("resume_from")
        return MARKS[mark] + (" and loading the checkpoint" if resuming else "")
    started = session.get("started") or status.get("started")
    placement = session.get("placement")
    ranks = placement.get("nproc") if isinstance(placement, dict) else None  # this node's
    up = [
        b
        for b in read_heartbeats(run_dir)
        if b.get("phase") == "starting"
        and (not isinstance(started, (int, float)) or (b.get("since") or 0) >= started)
    ]
    if up:
        of = f"/{ranks}" if isinstance(ranks, int) else ""
        return f"{len(up)}{of} ranks up: importing torch, then joining the process group"
    pids = status.get("pids")
    if isinstance(pids, dict) and pids.get("torchrun"):
        return "torchrun started: importing torch, spawning the ranks"
    if status:
        return "supervisor up: starting torchrun"
    return "launching: starting the supervisor"
