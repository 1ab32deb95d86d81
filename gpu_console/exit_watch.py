"""Sleep a poll interval, but wake the moment a child process exits.

The supervisor polls torchrun, and the headless console the supervisor, a few times a second;
a plain sleep makes every run's end wait for the rest of the interval (up to the whole of it)
before anyone notices. A pidfd (Linux 5.3+) becomes readable when its process exits, so a
``select`` on it sleeps as long as before and no longer than needed. Elsewhere, a plain sleep.
No torch here.
"""

from __future__ import annotations

import contextlib
import os
import select
import time


class ExitWatch:
    def __init__(self, pid: int | None):
        self._fd: int | None = None
        if pid is not None:
            with contextlib.suppress(AttributeError, OSError):  # no pidfd_open, or pid gone
                self._fd = os.pidfd_open(pid)

    def sleep(self, seconds: float) -> None:
        """Up to ``seconds``; at once when the process has exited (then on every call)."""
        if self._fd is None:
            time.sleep(seconds)
            return
        try:
            select.select([self._fd], [], [], seconds)
        except (OSError, ValueError):
            self.close()
            time.sleep(seconds)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
