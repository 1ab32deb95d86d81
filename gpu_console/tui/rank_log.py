"""The ranks' output (``logs/torchrun.log``) as the log pane shows it (no Textual, no torch).

Each line gets torchrun's rank prefix as ``r3│`` and a level. Two kinds of line are not
shown as they come:

- the echo of a log event: the engine prints every ``log`` event it writes (a task's
  ``ctx.log``, the engine's own notes) to the rank's stderr as ``[level] message``
  (``engine/reporter.py``), which torchrun copies here; the pane already shows the event, so
  each event cancels one such line (:class:`Echoes`);
- torch.profiler's own chatter (kineto's ``STAGE:``/``USDT:``/``INFO:`` lines, a few for each
  capture and rank): folded into one line, the first time. Its ``WARNING:`` and ``ERROR:``
  lines are kept.
"""

from __future__ import annotations

import re
from collections import Counter, deque

# kineto's glog-style prefix: "STAGE:2024-01-01 10:00:00 1234:1234 ActivityProfiler...cpp:314]".
_KINETO = re.compile(r"(STAGE|USDT|INFO|LOG):\d{4}-\d\d-\d\d [\d:. ]+\d+:\d+ \S+\.(cpp|h):\d+\]")
PROFILER_FOLDED = "(torch.profiler's own start and stop lines are not shown)"
REMEMBERED = 1024  # log events whose echo may still come


def shown_as(line: str) -> str:
    """torchrun's ``[default3]:text`` (its --tee prefix) shown as ``r3│ text``."""
    if line.startswith("[default") and "]:" in line[:16]:
        rank, _, rest = line[8:].partition("]:")
        if rank.isdigit():
            return f"r{rank}│ {rest}"
    return line


def _prefixed(text: str) -> bool:
    """Whether a shown line carries a rank's prefix (``r3│ ``, :func:`shown_as`)."""
    return text.startswith("r") and "│ " in text[:8]


def without_rank(text: str) -> str:
    return text.split("│ ", 1)[1] if _prefixed(text) else text


def level_of(text: str) -> str:
    low = text.lower()
    if any(w in low for w in ("error", "traceback", "exception", "failed", "fatal")):
        return "error"
    if "warn" in low:
        return "warning"
    return "info"


def profiler_noise(text: str) -> bool:
    """A line torch.profiler (kineto) prints for itself at each start and stop."""
    return _KINETO.match(without_rank(text)) is not None


_ECHO = re.compile(r"\[(info|warning|error|debug)\] ")


def echo_candidate(text: str) -> str | None:
    """A shown line's ``[level] message`` if it may be the echo of a log event, else None.

    Only the rank that writes the run's events echoes them: the node's first (torchrun's
    prefix is the local rank, so ``r0│``), or a line with no prefix. Another rank's line in
    the same shape is that rank's own (a task's ``ctx.log`` on rank 1), never an echo."""
    if _prefixed(text) and not text.startswith("r0│ "):
        return None
    bare = without_rank(text)
    return bare if _ECHO.match(bare) is not None else None


class Echoes:
    """The lines of log events the pane showed, until the rank's echo of each arrives.

    The echo is printed after the event is written, so a reader that takes events before
    the ranks' output meets the event first, unless the event was written between its two
    reads: then the echo comes first, and the feed keeps an echo-like line back for one read
    (:func:`echo_candidate`) before it shows it. A line is hidden once for each event.
    """

    def __init__(self) -> None:
        self._waiting: Counter[str] = Counter()
        self._order: deque[str] = deque()

    def shown(self, text: str) -> None:
        """A log event's text as the pane showed it (``[level] message``)."""
        for line in text.splitlines() or [text]:  # printed, a message of lines is lines
            self._waiting[line] += 1
            self._order.append(line)
        while len(self._order) > REMEMBERED:  # an echo that never came (a full disk)
            self._forget(self._order.popleft())

    def is_echo(self, text: str) -> bool:
        """Whether a line of the ranks' output (prefix removed) is an event's echo."""
        if not self._waiting[text]:
            del self._waiting[text]
            return False
        self._forget(text)
        self._order.remove(text)
        return True

    def _forget(self, line: str) -> None:
        self._waiting[line] -= 1
        if self._waiting[line] <= 0:
            del self._waiting[line]
