"""A full disk (ENOSPC) or a quota reached (EDQUOT), however the writer says so. No torch here.

Writers do not agree on how they report it: Python raises ``OSError`` with an errno, but
``torch.save``'s zip writer raises a ``RuntimeError`` (``unexpected pos 45184 vs 45136``)
whose context holds the ``OSError`` only when it wrote through a Python file, and nothing
at all when it wrote to a path. :func:`classify` looks for the errno in the exception's
cause chain first; failing that, it asks the file system whether the write could have fit.
The result is typed where the write failed (:class:`DiskFull`) and rendered in one line
that names the free space (``no space left on /runs (12 KiB free)``).

The reserve (:func:`make_reserve`): a small file per writer in the run directory, written
at launch, that its writer deletes when it meets a full disk, so that its last words (the
supervisor's final status.json, the engine's last events) still fit. Deleting a file frees
its blocks on every file system, quotas included, while space "kept free" by any other
means is taken by the next checkpoint write.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .format import human_bytes

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A write whose size is unknown "could not have fit" below this much free space.
LOW_SPACE = 1 << 20
RESERVE_BYTES = 128 << 10  # a few final status.json rewrites and events, many times over


class DiskFull(OSError):
    """A write failed for want of space (``errno``: ENOSPC or EDQUOT) on ``where``'s file
    system, ``free`` bytes left there (None: unknown)."""

    def __init__(self, code: int, where: Path | str, free: int | None):
        super().__init__(code, os.strerror(code))
        self.where = str(where)
        self.free = free

    def __str__(self) -> str:
        what = "disk quota exceeded" if self.errno == errno.EDQUOT else "no space left"
        left = f" ({human_bytes(self.free)} free)" if self.free is not None else ""
        return f"{what} on {self.where}{left}"

    def __reduce__(self):  # crosses processes (broadcast_object_list) as itself
        return (DiskFull, (self.errno, self.where, self.free))


def free_bytes(path: Path | str) -> int | None:
    """Free bytes on ``path``'s file system (the nearest existing parent's), as its user sees
    them; root may use the blocks kept for it too."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def mount_of(path: Path | str) -> str:
    """The mount point ``path`` lives on: the place a full disk is named by."""
    p = Path(os.path.abspath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def _chain(exc: BaseException):
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        yield at
        at = at.__cause__ or at.__context__


def full_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when an OSError of the chain carries it; 0 when the chain's first
    errno is another one (that failure is not about space); None when no errno is there."""
    for e in _chain(exc):
        if isinstance(e, DiskFull):
            return e.errno
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno if e.errno in FULL_ERRNOS else 0
    return None


def classify(exc: BaseException, where: Path | str, need: int | None = None) -> DiskFull | None:
    """``exc`` as a :class:`DiskFull` when it is one, else None.

    ``need``: bytes the failed write still had to write, when known; without an errno, the
    write counts as failed for want of space when less than that (else :data:`LOW_SPACE`) is
    free. A writer that says nothing about why (torch's zip writer to a path) on a disk with
    room to spare is a failure of another kind, left to its caller.
    """
    if isinstance(exc, DiskFull):
        return exc
    code = full_errno(exc)
    free = free_bytes(where)
    if code:
        return DiskFull(code, mount_of(where), free)
    silent = code is None and isinstance(exc, (RuntimeError, OSError))  # no errno to go by
    if silent and free is not None and free < max(need or 0, LOW_SPACE):
        return DiskFull(errno.ENOSPC, mount_of(where), free)
    return None


def short_of_room(where: Path | str, need: int) -> DiskFull | None:
    """A :class:`DiskFull` when less than ``need`` bytes are free on ``where``'s disk."""
    free = free_bytes(where)
    if free is not None and free < need:
        return DiskFull(errno.ENOSPC, mount_of(where), free)
    return None


# What a session writes before its first checkpoint, the reserves above all: a resume
# refused up front leaves nothing half-done (run.toml rewritten, meta.json not).
SESSION_ROOM = 2 * RESERVE_BYTES + LOW_SPACE


def reserve_path(run_dir: Path, writer: str) -> Path:
    return Path(run_dir) / f".reserve-{writer}"


def make_reserve(run_dir: Path, writer: str, size: int = RESERVE_BYTES) -> bool:
    """Write ``writer``'s reserve (real blocks: random bytes, which no file system stores
    sparse or compressed). False when the disk has no room for it (the run goes on)."""
    path = reserve_path(run_dir, writer)
    try:
        if path.stat().st_size >= size:
            return True
    except OSError:
        pass
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return False


def free_reserve(run_dir: Path, writer: str) -> bool:
    """Delete ``writer``'s reserve: True when there was one to free."""
    try:
        reserve_path(run_dir, writer).unlink()
        return True
    except OSError:
        return False


def append_whole(fd: int, data: bytes) -> None:
    """All of ``data`` at the end of ``fd`` (opened O_APPEND, one writer), or nothing: a short
    write (the disk filled up during it) is cut back off, so no torn line is left for the
    next line to be glued to."""
    start = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise
