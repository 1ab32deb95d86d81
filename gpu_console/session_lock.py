"""One session per run: an OS lock on ``RUN/.lock`` that the kernel releases when its holder dies.

The console that launches or resumes a run takes it (never waits for it) before it writes
anything in the run directory, and hands it to the supervisor (``pass_fds``), which holds it
for the whole session; torchrun and the ranks never inherit it. So:

- a second session of the same run is refused at once, however close the two starts are
  (a check of status.json, then a write, is a race; a lock is not);
- a reader that *can* take the lock knows that no session is live, whatever status.json
  says: a supervisor killed by SIGKILL (or by the OOM killer) released it by dying.

``flock`` locks an open file description: every descriptor dup'd or inherited from it holds
the same lock, and it is released when the last of them closes. The file holds the pid of
the holder that last claimed it (the console, then its supervisor), for the loser's message.
No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from .runs import RunDirError

LOCK = ".lock"
# A reader holds the lock for a few milliseconds (to record a lost run): a session that finds
# it taken tries again this long before it says another session holds the run.
TAKE_WAIT_S = 1.0


class RunLockedError(RunDirError):
    """Another session (a console starting it, or its supervisor) holds the run (exit 2)."""

    def __init__(self, run_dir: Path, pid: int | None, what: str = "--resume"):
        self.pid = pid
        holder = f" (pid {pid})" if pid else ""
        super().__init__(
            f"{what}: {run_dir}: another session holds it{holder}; one session per run at a "
            f"time: wait for it to end, or stop it (gpu-console stop {run_dir})"
        )


class SessionLock:
    """A held lock: its descriptor, closed once by :meth:`release` (or by process exit)."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = Path(run_dir), fd

    def claim(self, pid: int) -> None:
        """Name ``pid`` as the holder (what a refused session's message shows)."""
        with contextlib.suppress(OSError):  # a full disk does not unlock the run
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{pid}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SessionLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def try_take(run_dir: Path, create: bool = True) -> SessionLock | None:
    """The run's lock if nobody holds it, else None (never waits). ``create=False``: None
    also when the run has no lock file (a run made before this lock existed)."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(Path(run_dir) / LOCK, flags, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return SessionLock(run_dir, fd)


def take(run_dir: Path, what: str = "--resume", wait_s: float = TAKE_WAIT_S) -> SessionLock:
    """The lock for a new session of ``run_dir``; raises :class:`RunLockedError` when
    another session holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock = try_take(run_dir)
        except OSError as e:
            raise RunDirError(f"{what}: {run_dir}: cannot lock the run ({e.strerror})") from None
        if lock is not None:
            return lock  # claimed by the session once it writes (a refused one writes nothing)
        if time.monotonic() >= deadline:
            raise RunLockedError(run_dir, holder(run_dir), what)
        time.sleep(0.05)


def holder(run_dir: Path) -> int | None:
    """The pid the lock file names (the session's supervisor once it started), if any."""
    try:
        text = (Path(run_dir) / LOCK).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def is_held(run_dir: Path) -> bool | None:
    """True while a session holds the run, False when none does; None for a run without a
    lock file (made before this lock existed: only its pids can tell)."""
    if not (Path(run_dir) / LOCK).exists():
        return None
    try:
        lock = try_take(run_dir, create=False)
    except OSError:
        return None
    if lock is None:
        return (Path(run_dir) / LOCK).exists() or None
    lock.release()
    return False
