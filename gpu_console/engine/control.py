"""Control between steps: console commands and scheduler signals, agreed by every rank.

Rank 0 reads ``control.jsonl``; signals can reach any rank. At a check, one small
all_reduce(MAX) carries rank 0's command, every rank's signal flag and rank 0's choice of
the next check step, so all ranks act on the same step. Checks are spaced by measured step
time (about every ``interval_s``), so fast steps do not pay a collective each.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..events import CONTROL_COMMANDS, JsonlTail

CODES = {cmd: i + 1 for i, cmd in enumerate(CONTROL_COMMANDS)}
NAMES = {v: k for k, v in CODES.items()}


@dataclass
class Decision:
    cmd: str | None  # one of CONTROL_COMMANDS, or None
    cmd_id: str | None
    signalled: bool


class Control:
    def __init__(self, run_dir: Path, is_main: bool, device: torch.device, interval_s: float):
        self.is_main = is_main
        self.device = device
        self.interval_s = interval_s
        self.tail = JsonlTail(Path(run_dir) / "control.jsonl") if is_main else None
        self._owner_ok = _owned_by_me(Path(run_dir) / "control.jsonl") if is_main else True
        self.pending: deque[dict] = deque()
        self.next_check = 1
        self.signalled = False
        self.stop_pending = False
        self._last_check_t = time.perf_counter()
        self._last_check_step = 0
        self._buf = torch.zeros(3, dtype=torch.int64, device=device)
        self.rejected: list[dict] = []

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.stop_pending or self.signalled:
            # Asked twice: the graceful path is already under way or stuck; leave now.
            os._exit(128 + signum)
        self.signalled = True

    def _read_commands(self) -> None:
        if self.tail is None or not self._owner_ok:
            return
        for cmd in self.tail.read():
            if cmd.get("cmd") in CODES and isinstance(cmd.get("id"), str):
                self.pending.append(cmd)
            else:
                self.rejected.append(cmd)

    def due(self, step: int) -> bool:
        return step >= self.next_check

    def check(self, step: int, force: bool = False) -> Decision:
        """Collective. Call on every rank when :meth:`due` is true (or ``force``)."""
        cmd = None
        if self.is_main:
            self._read_commands()
            cmd = self.pending.popleft() if self.pending else None
            now = time.perf_counter()
            steps = max(1, step - self._last_check_step)
            per_step = (now - self._last_check_t) / steps
            ahead = 1 if self.pending else max(1, int(self.interval_s / max(per_step, 1e-6)))
            self._last_check_t, self._last_check_step = now, step
            self._buf[0] = CODES[cmd["cmd"]] if cmd else 0
            self._buf[2] = step + min(ahead, 10_000)
        else:
            self._buf[0] = 0
            self._buf[2] = 0
        self._buf[1] = int(self.signalled)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX)
        code, signalled, next_check = (int(v) for v in self._buf.tolist())
        self.next_check = next_check
        return Decision(NAMES.get(code), cmd["id"] if cmd else None, bool(signalled))


def _owned_by_me(path: Path) -> bool:
    """Commands are taken only from a control file this user owns (DESIGN: who may touch)."""
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return True
