"""A process's children, cheaply, for what asks several times a second.

psutil finds children by reading the stat file of every process on the machine (a GPU
node runs hundreds); the supervisor asked five times a second and the telemetry recorder
once a second, which cost a running run some 2 % of a core (benchmarks/overhead.py). The
kernel keeps each thread's children in ``/proc/PID/task/TID/children``: a read per thread
of the process asked about. psutil has no call for it, hence these few lines.

The kernel's list may miss a child forked or reaped during the read, so a caller that
would act on a child's absence confirms it first (the supervisor's ``_watch_workers``).
Without the lists (a kernel built without CONFIG_PROC_CHILDREN), psutil's walk.
"""

from __future__ import annotations

import os

import psutil


def child_pids(pid: int) -> list[int] | None:
    """``pid``'s children's pids, from the kernel's lists; None where it has none (then
    ask psutil). A process that is gone has no children."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    except OSError:
        return None
    out: list[int] = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += map(int, f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended between the listing and the read
            return None  # the kernel keeps no lists
        except OSError:
            return None
    return out


def children(
    proc: psutil.Process, recursive: bool = False, known: dict[int, psutil.Process] | None = None
) -> list[psutil.Process]:
    """As ``proc.children(recursive)``; ``known``: Process objects already made, reused
    when their pid is listed again (a Process checks its start time, so a reused pid is
    not taken for the old process)."""
    pids = child_pids(proc.pid)
    if pids is None:
        return proc.children(recursive=recursive)
    out: list[psutil.Process] = []
    for pid in pids:
        p = (known or {}).get(pid)
        if p is None or not p.is_running():
            try:
                p = psutil.Process(pid)
            except psutil.Error:
                continue
        out.append(p)
        if recursive:
            out += children(p, True, known)
    return out
