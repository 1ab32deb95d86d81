"""``ls``, ``stop``, ``checkpoint`` and ``dump``: operate runs from any shell (no torch here).

Commands reach a run only through its directory: ``control.jsonl`` for requests, events
for their acknowledgement, status.json and the ranks' heartbeats for pids. A command to an
ended run is a bad input.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import psutil

from .. import strict_json
from ..events import append_control, read_events
from ..fold import StalledError
from ..lost import settle
from ..runs import (
    FINAL_STATES,
    RunDirError,
    damage,
    find_run,
    given_name,
    is_run,
    profile_name,
    read_json,
    read_status,
    rebased,
    status_exit_code,
)
from ..session_lock import is_held
from ..stall import quiet_s
from ..state import derived_state, describe_stopped, gpu_figures, read_heartbeats

DUMP_TIMEOUT_S = 30.0

ACK_TIMEOUT_S = 60.0


class RunEndedError(RunDirError):
    """A control command to a run that is no longer running."""


def list_runs(runs_dir: Path) -> list[dict[str, Any]]:
    """Every run under ``runs_dir``, newest first: ``ls`` (and ``attach``, the runs screen)."""
    if not Path(runs_dir).is_dir():
        return []
    runs = [run for run in sorted(Path(runs_dir).iterdir()) if is_run(run)]
    rows = run_rows(runs)
    # The newest session first: a run resumed now is the one ``attach`` opens by default.
    rows.sort(key=lambda r: r["session_started"], reverse=True)
    return rows


def run_rows(runs: list[Path]) -> list[dict[str, Any]]:
    """One row per run, from its status.json: what ``ls`` shows and ``status`` starts from.

    A run whose supervisor died without recording its end is recorded ``lost`` here first
    (:func:`lost.settle`), so status.json, ``ls`` and ``status`` give one state and step.
    ``started``: when the run began (its first session); ``session_started``: when its
    latest session (a resume) began; ``updated``: its newest word (the last step, or its
    end); ``age_s``: seconds since ``updated``; ``damaged``: what the directory lacks
    (:func:`runs.damage`). Paths are this directory's (a copied run names its own files).
    """
    now = time.time()
    rows = []
    for run in runs:
        status = settle(run)
        session_started = status.get("started") or run.stat().st_mtime
        started = _first_start(run) or session_started
        last = status.get("ended") or status.get("last_step_t") or session_started
        state = derived_state(status, now, run_dir=run)
        rows.append(
            {
                "name": run.name,
                "path": str(run),
                "profile": profile_name(run),  # run.toml's [profile] name: ls --profile
                "run_name": given_name(run),  # --name's (meta.json), as the user spelled it
                "state": state,
                "reason": status.get("reason", ""),
                "step": status.get("step"),
                "max_steps": status.get("max_steps"),
                "loss": status.get("loss"),
                "best_loss": status.get("best_loss"),  # finite losses, every session's
                "skipped_updates": status.get("skipped_updates"),  # nan_policy = "skip"
                "best_checkpoint": _here(run, status.get("best_checkpoint")),  # keep_best
                "exit_code": status_exit_code(status, state),  # None while live
                "restarts": status.get("restarts") or 0,
                "mfu": status.get("mfu_mean"),  # the session's mean; None with the reason:
                "mfu_not_shown": status.get("mfu_not_shown"),
                "started": started,
                "session_started": session_started,
                "updated": last,
                "age_s": round(now - last, 1),
                "damaged": damage(run),
            }
        )
    return rows


def _here(run: Path, recorded: Any) -> dict[str, Any] | None:
    """A checkpoint status.json recorded, with its path as this run directory has it."""
    if not isinstance(recorded, dict):
        return None
    path = rebased(run, recorded.get("path"))
    return {**recorded, "path": str(path.absolute()) if path else None}


def _first_start(run: Path) -> float | None:
    """When the run began: meta.json's ``created`` (its first session's start)."""
    meta = read_json(run / "meta.json")
    created = meta.get("created") if isinstance(meta, dict) else None
    return created if isinstance(created, (int, float)) and not isinstance(created, bool) else None


def _live(run: Path) -> dict[str, Any]:
    """status.json of a run a session is running; else a command to it would be read by no
    one: refused (:class:`RunEndedError`), nothing appended.

    Live means a session holds the run's lock (:mod:`.session_lock`), whatever status.json
    says (a supervisor that was SIGKILLed cannot say it); a run made before the lock is
    judged by its supervisor's pid.
    """
    status = settle(run)
    held = is_held(run)
    state = derived_state(status, time.time())
    if held is True and not status.get("ended") and state not in FINAL_STATES:
        # Running, or starting: the lock is taken before the supervisor's first status.json
        # (and a resume removes the last session's), so its pid is waited for, not guessed.
        return status if _supervisor_pid(status) else _await_supervisor(run)
    # A final state without ``ended``: the engine has ended the run and its session is
    # winding down (the lock is still held): no rank will read a command again.
    if held is False and state not in FINAL_STATES and state != "lost":
        raise RunEndedError(f"{run}: no session is running the run (state {state}); nothing sent")
    if state in FINAL_STATES or state == "lost":
        raise RunEndedError(f"{run}: the run has already ended (state {state})")
    return status


# How long a command waits for a starting session's supervisor to write status.json.
SUPERVISOR_WAIT_S = 15.0


def _supervisor_pid(status: dict[str, Any]) -> int | None:
    pids = status.get("pids")
    pid = pids.get("supervisor") if isinstance(pids, dict) else None
    return pid if type(pid) is int and pid > 0 else None


def _await_supervisor(run: Path) -> dict[str, Any]:
    deadline = time.monotonic() + SUPERVISOR_WAIT_S
    while time.monotonic() < deadline:
        status = read_status(run)
        if _supervisor_pid(status):
            return status
        if is_held(run) is False:
            break  # the launch gave up before its supervisor started: nothing runs it
        time.sleep(0.05)
    raise RunEndedError(
        f"{run}: the run is starting and its supervisor has not written status.json yet "
        f"({SUPERVISOR_WAIT_S:.0f} s); nothing sent, try again"
    )


def request(run_arg: str, runs_dir: Path, cmd: str, wait_s: float = ACK_TIMEOUT_S):
    """Append ``cmd`` and wait for the engine's acknowledgement; return (run, ack events).

    Every command is acted on at a step boundary, which a stalled run cannot reach: to one,
    :class:`StalledError` at once (nothing sent), or as soon as it stalls while waiting.
    """
    run = find_run(run_arg, runs_dir)
    if derived_state(_live(run), time.time(), run_dir=run) == "stalled":
        raise StalledError(stalled_text(run, cmd, sent=False))
    cid = append_control(run, cmd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        acks = [e for e in read_events(run / "events.jsonl") if e.get("id") == cid]
        if any(a.get("state") in ("done", "rejected") for a in acks):
            return run, cid, acks
        state = derived_state(read_status(run), time.time(), run_dir=run)
        if state in (*FINAL_STATES, "lost"):
            return run, cid, acks
        if state == "stalled":
            raise StalledError(stalled_text(run, cmd, sent=True))
        time.sleep(0.1)
    return run, cid, []


def stalled_text(run: Path, cmd: str, sent: bool) -> str:
    """``RUN is stalled: rank 1 (no heartbeat for 42 s); a graceful stop needs a step
    boundary; use gpu-console stop RUN --now``: the one line a request to a stalled run gets."""
    now = time.time()
    status = read_status(run)
    who = describe_stopped(read_heartbeats(run), now)
    if not who and (quiet := quiet_s(status, now, run)) is not None:
        who = f"no step for {quiet:.0f} s"
    what = {"stop": "a graceful stop", "checkpoint": "a checkpoint"}.get(cmd, f"'{cmd}'")
    text = f"{run.name} is stalled: {who or 'no sign of life'}; {what} needs a step boundary"
    if sent:  # it stays queued: a run that moves again acts on it
        text += f" (the {cmd} request is queued for when it moves again)"
    if cmd == "stop":
        text += f"; use gpu-console stop {run.name} --now"
    else:
        text += f"; gpu-console dump {run.name} shows where each rank is"
    return text


# The supervisor's kill on request (supervisor.KILLS): ``killed``, exit 137, no checkpoint.
KILL_SIGNAL = signal.SIGUSR2
KILL_WAIT_S = 10.0


def stop_now(run_arg: str, runs_dir: Path, wait_s: float = KILL_WAIT_S) -> tuple[Path, dict]:
    """Kill the run now: its supervisor records ``killed``, then SIGKILLs every process of it.

    Returns the run and its status.json once the supervisor recorded the end (waiting up to
    ``wait_s``; ``{}`` if it has not by then: the kill was delivered all the same).
    """
    run = find_run(run_arg, runs_dir)
    status = _live(run)
    pids = status.get("pids", {})
    try:
        os.kill(pids["supervisor"], KILL_SIGNAL)
    except (KeyError, TypeError, ProcessLookupError):
        # No supervisor to record it (the run shows lost): its processes are killed here.
        for pid in [pids.get("torchrun"), *(pids.get("workers") or [])]:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return run, {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = read_status(run)
        if status.get("ended"):
            return run, status
        time.sleep(0.05)
    return run, {}


def checkpoint_after(run: Path, cid: str) -> dict[str, Any] | None:
    """The checkpoint that answers request ``cid``: the one written for it (its event follows
    the 'received' ack), or the one its step already had (named in the 'done' ack)."""
    seen = False
    for e in read_events(run / "events.jsonl"):
        if e.get("kind") == "control" and e.get("id") == cid:
            seen = True
            if isinstance(e.get("checkpoint"), dict):
                return e["checkpoint"]
        elif seen and e.get("kind") == "checkpoint":
            return e
    return None


def to_json(rows: list[dict[str, Any]]) -> str:
    """``ls --json``: each run with its GPUs' figures (``[]`` without GPUs), read here only:
    the table, ``attach`` and the runs screen list runs without them."""
    return strict_json.dumps([json_row(r) for r in rows], indent=2)


def json_row(row: dict[str, Any]) -> dict[str, Any]:
    """A run's ``ls --json`` entry (``status --json`` adds its summary's fields)."""
    return {**row, "gpus": gpu_figures(Path(row["path"]))}


LS_COLUMNS = ("run", "state", "step", "loss", "started", "updated")


def ls_main(
    runs_dir: Path,
    as_json: bool,
    states: list[str] | None = None,
    since: str | None = None,
    profile: str | None = None,
    sort: str | None = None,
) -> None:
    """``ls``: a table, or JSON. ``started`` and ``updated`` are how long ago the run began
    and last moved (its last step, or its end). Filters and the order: :mod:`.select`."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ..format import fmt, human_duration, steps_text, uncut
    from . import select

    # Every option is judged before a run is read.
    wanted = select.parse_states(states or [])
    after = select.parse_since(since) if since is not None else None
    if sort is not None:
        select.sort_rows([], sort)
    rows = list_runs(runs_dir)
    filtered = wanted is not None or after is not None or profile is not None
    rows = select.select(rows, wanted, after, profile)
    if sort is not None:  # else list_runs' order: the newest session first
        rows = select.sort_rows(rows, sort)
    if as_json:
        print(to_json(rows))
        return
    if not rows:
        print(f"no run under {runs_dir} matches" if filtered else f"no runs under {runs_dir}")
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in LS_COLUMNS:
        table.add_column(col, overflow="fold")
    for r in rows:
        step = steps_text(r["step"], r["max_steps"])
        started, updated = (human_duration(now - t) + " ago" for t in (r["started"], r["updated"]))
        table.add_row(Text(r["name"]), r["state"], step, fmt(r["loss"]), started, updated)
    console = uncut(Console())
    console.print(table)
    for r in rows:  # below the table, whole: what each half-deleted run lacks
        if r["damaged"]:
            line = f"{r['name']}: damaged: {'; '.join(r['damaged'])}"
            console.print(Text(line), soft_wrap=True, highlight=False)


def py_spy() -> str | None:
    """The py-spy binary: on PATH, else beside this Python (a virtualenv's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def rank_pids(run: Path, status: dict[str, Any]) -> list[tuple[int | None, int]]:
    """(rank, pid) of the run's live ranks on this node: heartbeats name them."""
    workers = set(status.get("pids", {}).get("workers") or [])
    out: dict[int, int | None] = {}
    for beat in read_heartbeats(run):
        pid = beat.get("pid")
        if isinstance(pid, int) and beat.get("phase") not in ("done", "failed"):
            out[pid] = beat["rank"]
    for pid in workers:
        out.setdefault(pid, None)
    alive = []
    for pid, rank in out.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and "gpu_console.engine" in proc.cmdline():
                alive.append((rank, pid))
    return sorted(alive, key=lambda rp: (rp[0] is None, rp[0] or 0, rp[1]))


def dump(run_arg: str, runs_dir: Path, binary: str) -> tuple[Path, list[dict[str, Any]]]:
    """``py-spy dump`` of every live rank into ``RUN/dumps/<time>/rank-N.txt``."""
    run = find_run(run_arg, runs_dir)
    status = _live(run)
    ranks = rank_pids(run, status)
    if not ranks:
        raise RunEndedError(f"{run}: no live rank on this machine to dump")
    folder = run / "dumps" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    results = []
    for rank, pid in ranks:
        name = f"rank-{rank}" if rank is not None else f"pid-{pid}"
        try:
            proc = subprocess.run(
                [binary, "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
            )
            ok, text = proc.returncode == 0, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            ok, text = False, f"py-spy dump timed out after {DUMP_TIMEOUT_S:.0f}s"
        path = folder / f"{name}.txt"
        path.write_text(f"# rank {rank} pid {pid}\n{text}")
        results.append({"rank": rank, "pid": pid, "path": path, "ok": ok, "text": text})
    return folder, results


def dump_main(run_arg: str, runs_dir: Path) -> int:
    """The ``dump`` command: 0 when every rank's stack was written, else 1 saying why."""
    binary = py_spy()
    if binary is None:
        print(
            "gpu-console: dump needs py-spy, which is not installed here "
            "(pip install py-spy); no stack was written",
            file=sys.stderr,
        )
        return 1
    folder, results = dump(run_arg, runs_dir, binary)
    for r in results:
        who = f"rank {r['rank']}" if r["rank"] is not None else f"pid {r['pid']}"
        if r["ok"]:
            print(f"{who} (pid {r['pid']}): {r['path']}")
        else:
            why = " / ".join(r["text"].strip().splitlines()[-3:]) or "no output"
            print(f"{who} (pid {r['pid']}): py-spy failed: {why}", file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1
