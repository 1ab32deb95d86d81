"""A child process's output copied into a log file without a terminal's control sequences.

Some programs colour their lines whatever they write to: wandb's core (a Go process the W&B
follower starts, writing to the stdout it inherits) prints ``^[[1;34mwandb^[[0m: Find logs
at ...`` into ``logs/wandb.log``, where it reads as noise in a pager and in the console's
log view. The child writes into a pipe; a thread copies each line to the file, the colour
codes (CSI) and terminal links or titles (OSC) taken out. The copy ends when every process
holding the pipe has closed it (the child and whatever it started).
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import IO

_CONTROL = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def strip_control(data: bytes) -> bytes:
    return _CONTROL.sub(b"", data)


class PlainCopy:
    """Copies ``source`` (a pipe's reading end) into ``path`` (appended), line by line."""

    def __init__(self, source: IO[bytes], path: Path):
        self._source = source
        self._path = path
        self._thread = threading.Thread(target=self._run, name=f"copy to {path.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        out = None
        with contextlib.suppress(OSError):  # a full disk may refuse it
            out = open(self._path, "ab")  # noqa: SIM115 (closed below)
        with self._source:
            for line in iter(self._source.readline, b""):
                if out is None:
                    continue  # keep reading: a child blocked on a full pipe would hang
                try:
                    out.write(strip_control(line))
                    out.flush()
                except OSError:  # a full disk: the lines are lost, the child is not blocked
                    out = None
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()
