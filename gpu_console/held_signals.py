"""The scheduler's signals (SIGTERM, SIGUSR1), held until a process can act on them.

SLURM signals every process of a job step at once (``--signal=USR1@120``, ``scancel
--signal``): the console, the supervisor, torchrun and the ranks, whatever each is doing.
A process that has not yet installed its handler dies of SIGUSR1's default action, and the
job then fails instead of checkpointing and requeueing. So the ``run`` command blocks both
first thing (:mod:`.entry`); a blocked signal is not lost but pending, and every process
started from there inherits the mask: each lets them through once its handlers are in place
(the console's follower, the supervisor, a rank), and the pending signal is handled then.

torchrun keeps SIGUSR1 blocked for its life (:data:`TORCHRUN_HOLDS`): the request is the
supervisor's and the ranks', and torchrun's own handling would end its workers without a
checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SCHEDULER = frozenset({signal.SIGTERM, signal.SIGUSR1})
TORCHRUN_HOLDS = frozenset({signal.SIGUSR1})


def hold(signals: frozenset[int] = SCHEDULER) -> None:
    """Block ``signals`` in this thread (and in what it starts from now on)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def release(signals: frozenset[int] = SCHEDULER) -> None:
    """Let ``signals`` through: one that came while they were held is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def pending() -> set[int]:
    """The scheduler's signals that came while held, not yet handled."""
    return set(signal.sigpending()) & SCHEDULER


@contextlib.contextmanager
def held_for_child(signals: frozenset[int] = SCHEDULER) -> Iterator[None]:
    """Around starting a process that installs its own handlers: the child starts with
    ``signals`` blocked (a thread's mask is what its fork inherits); this thread's mask is
    restored afterwards."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
