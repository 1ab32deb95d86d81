"""A process's output into its log file without a terminal's control sequences.

Some programs colour their lines whatever they write to: wandb's core (a Go process the W&B
follower starts, writing to the stdout it inherits) prints ``^[[1;34mwandb^[[0m: Find logs
at ...`` into ``logs/wandb.log``, where it reads as noise in a pager and in the console's
log view. :func:`plain_stdio` puts a pipe in place of the process's stdout and stderr, which
its children inherit, and a thread of the same process copies each line to the file they
were, the colour codes (CSI) and terminal links or titles (OSC) taken out. The copy lives
and ends with the process that owns the file: the supervisor dying changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import IO

_CONTROL = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def strip_control(data: bytes) -> bytes:
    return _CONTROL.sub(b"", data)


class PlainCopy:
    """Copies ``source`` (a pipe's reading end) into ``out``, line by line, until every
    process holding the pipe's writing end has closed it."""

    def __init__(self, source: IO[bytes], out: IO[bytes]):
        self._source, self._out = source, out
        self._thread = threading.Thread(target=self._run, name="plain copy", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        out: IO[bytes] | None = self._out
        with self._source:
            for line in iter(self._source.readline, b""):
                if out is None:
                    continue  # keep reading: a writer blocked on a full pipe would hang
                try:
                    out.write(strip_control(line))
                    out.flush()
                except OSError:  # a full disk: the lines are lost, the writers are not blocked
                    out = None
        with contextlib.suppress(OSError):
            self._out.close()


@contextlib.contextmanager
def plain_stdio(grace_s: float) -> Iterator[None]:
    """This process's fds 1 and 2 (and what its children inherit) through a
    :class:`PlainCopy` into the file fd 1 was. On leaving, they point nowhere, and the copy
    gets ``grace_s`` for what children still write (a process that ends after this one)."""
    out = os.fdopen(os.dup(1), "ab")
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)
    copy = PlainCopy(os.fdopen(read, "rb"), out)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 1)
        os.dup2(nowhere, 2)
        os.close(nowhere)
        copy.join(grace_s)
