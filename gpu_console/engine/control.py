"""Control between steps: console commands and scheduler signals, agreed by every rank.

The first rank of each node reads that node's ``control.jsonl`` (on one machine: rank 0
reads the run's file); signals can reach any rank (see :mod:`.signals`). At a check, every
rank's row of an exchange (see :mod:`.exchange`) carries its reader's command, its signal
flag and the readers' choice of the next check step, so all ranks act on the same step.
Every log step is a check, for free: its exchange rides with the gradients' all-reduce.
When log steps are further apart than ``interval_s``, checks in between (spaced by the
measured step time) make one small collective each. When readers on two nodes hold
different commands at once, the higher code wins and the other command stays queued for
the next check. A command's argument (``profile``'s steps) rides in the same row, beside
its code: every rank reads the same number.

A reader acts only on commands of its own session: those appended after its run was
launched or resumed (meta.json's ``control_from``), and not already acknowledged in the
events (a restarted group does not redo its predecessor's commands). A stop that ended the
previous session never stops the resumed one.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..events import CONTROL_COMMANDS, JsonlTail
from ..runs import current_session, read_json
from . import signals

CODES = {cmd: i + 1 for i, cmd in enumerate(CONTROL_COMMANDS)}
# The engine's own, never read from control.jsonl: a reader whose events cannot be written
# any longer (a full disk: reporter.Reporter.unwritable) ends the run, every rank at once.
# The highest code, so it wins over any command proposed at the same check.
GIVE_UP = "give_up"
CODES[GIVE_UP] = len(CODES) + 1
NAMES = {v: k for k, v in CODES.items()}


@dataclass
class Decision:
    cmd: str | None  # one of CONTROL_COMMANDS, or None
    cmd_id: str | None  # the id of the command, on the node whose file held it; else None
    signalled: bool
    arg: int = 0  # the command's argument (profile: steps; 0: missing or not a valid one)
    why: str = ""  # GIVE_UP's reason, on the reader that proposed it


class Control:
    def __init__(
        self,
        run_dir: Path,
        is_reader: bool,
        interval_s: float,
        give_up: Callable[[], str | None] | None = None,
    ):
        self.is_reader = is_reader
        self.give_up = give_up  # why this reader's node must end the run, else None
        self.interval_s = interval_s
        path = Path(run_dir) / "control.jsonl"
        self.tail = JsonlTail(path, _session_offset(run_dir)) if is_reader else None
        self.handled = _acknowledged(run_dir) if is_reader else set()
        self.owner_ok = True
        self.pending: deque[dict] = deque()
        self.next_check = 1
        self._last_check_t = time.perf_counter()
        self._last_check_step = 0
        self._cmd: dict | None = None  # the command proposed at the current check
        self.rejected: list[dict] = []
        self.warnings: list[str] = []  # for the events (the loop logs and clears them)

    @property
    def signalled(self) -> bool:
        return signals.signalled()

    def stopping(self) -> None:
        """A stop command is being carried out: a signal now escalates (see signals)."""
        signals.stopping()

    def _read_commands(self) -> None:
        if self.tail is None:
            return
        # Most checks find nothing new: a stat, not an open and read (issue 26). Lines read
        # are judged by the owner as it is after the read, as before.
        st = _stat(self.tail.path)
        grew = st is not None and st.st_size > self.tail.offset
        lines = self.tail.read() if grew else []
        owner_ok = _owned_by_me(_stat(self.tail.path) if grew else st)
        if not owner_ok:
            # Someone else's file (swapped in, or chowned): its lines are read and dropped,
            # never acted on, not even later should the file change hands again.
            if self.owner_ok:
                self.warnings.append(
                    f"{self.tail.path} is not owned by this run's user: its commands are ignored"
                )
            self.owner_ok = False
            self.rejected.extend(lines)
            return
        self.owner_ok = True
        for cmd in lines:
            if cmd.get("id") in self.handled:
                continue
            if cmd.get("cmd") in CONTROL_COMMANDS and isinstance(cmd.get("id"), str):
                self.pending.append(cmd)
            else:
                self.rejected.append(cmd)

    def due(self, step: int) -> bool:
        """Whether the step ``step`` (counted from 1) is a check: the same on every rank."""
        return step >= self.next_check

    def proposal(self, step: int) -> tuple[int, int, int, int]:
        """This rank's part of the check at ``step``: (command code, signalled, next check,
        the command's argument).

        A reader takes its next command and proposes when to look again, from the measured
        step time; other ranks propose nothing (0).
        """
        code = next_check = arg = 0
        self._cmd = None
        if self.is_reader:
            self._read_commands()
            self._cmd = self.pending.popleft() if self.pending else None
            if self.give_up is not None and (why := self.give_up()):
                if self._cmd is not None:
                    self.pending.appendleft(self._cmd)
                self._cmd = {"id": None, "cmd": GIVE_UP, "why": why}
            now = time.perf_counter()
            steps = max(1, step - self._last_check_step)
            per_step = (now - self._last_check_t) / steps
            ahead = 1 if self.pending else max(1, int(self.interval_s / max(per_step, 1e-6)))
            self._last_check_t, self._last_check_step = now, step
            code = CODES[self._cmd["cmd"]] if self._cmd else 0
            arg = argument(self._cmd) if self._cmd else 0
            next_check = step + min(ahead, 10_000)
        return code, int(self.signalled), next_check, arg

    def decide(self, step: int, proposals: list[tuple[int, int, int, int]]) -> Decision:
        """Every rank's proposals → the decision, the same on every rank."""
        code = max(p[0] for p in proposals)
        signalled = any(p[1] for p in proposals)
        soonest = min((p[2] for p in proposals if p[2]), default=step + 1)
        # After a command, look again at the next step: another may be queued on some node.
        self.next_check = step + 1 if code else max(soonest, step + 1)
        cmd, self._cmd = self._cmd, None
        mine = cmd is not None and CODES[cmd["cmd"]] == code
        if cmd is not None and not mine:
            self.pending.appendleft(cmd)  # another node's command won; ours goes next
        arg = max((p[3] for p in proposals if code and p[0] == code), default=0)
        mine_cmd = cmd if mine else None  # the narrowing mypy cannot see through ``mine``
        why = mine_cmd.get("why", "") if mine_cmd else ""
        return Decision(NAMES.get(code), mine_cmd["id"] if mine_cmd else None, signalled, arg, why)


# The most steps one profile capture may take: a trace grows with every step it holds.
MAX_PROFILE_STEPS = 1000


def argument(cmd: dict) -> int:
    """A command's argument as the ranks carry it: ``profile``'s steps, 0 when it has none
    or a wrong one (the engine then rejects the command, saying why)."""
    if cmd.get("cmd") != "profile":
        return 0
    steps = cmd.get("steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and 0 < steps <= MAX_PROFILE_STEPS:
        return steps
    return 0


def _session(run_dir: Path) -> dict:
    meta = read_json(Path(run_dir) / "meta.json")
    return current_session(meta) if isinstance(meta, dict) else {}


def _offset(session: dict, key: str) -> int:
    value = session.get(key)
    return value if isinstance(value, int) and value > 0 else 0


def _session_offset(run_dir: Path) -> int:
    """Where this session's commands begin in control.jsonl (0 for a run's first session)."""
    return _offset(_session(run_dir), "control_from")


def _acknowledged(run_dir: Path) -> set[str]:
    """Ids of the commands an earlier engine of this session (before a restart) took up."""
    start = _offset(_session(run_dir), "events_from")
    events = JsonlTail(Path(run_dir) / "events.jsonl", start).read()
    return {e["id"] for e in events if e.get("kind") == "control" and isinstance(e.get("id"), str)}


def _owned_by_me(st: os.stat_result | None) -> bool:
    """Commands are taken only from a control file this user owns (DESIGN: who may touch);
    ``st``: the file's stat, None when there is no file."""
    return st is None or st.st_uid == os.getuid()


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
