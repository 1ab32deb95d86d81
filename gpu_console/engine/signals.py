"""Scheduler signals in a rank: installed first thing, before torch is even imported.

SIGTERM and SIGUSR1 (SLURM preemption, ``scancel --signal``, Kubernetes, torchrun forwarding
them, the supervisor's graceful stop) only set a flag; the training loop shares it with every
rank at its next control check and stops there with a checkpoint (reason ``signal``).

A scheduler often signals every process of a job at once, so a rank may get the same request
two or three times within a moment (from the scheduler, from torchrun, from the supervisor):
those are one request. A SIGTERM that comes more than :data:`COALESCE_S` after the first
signal, while the graceful stop is still under way, means "the graceful path is stuck: leave
now"; a repeated SIGUSR1 (a scheduler's warning) is the same warning.

No torch here: a signal that arrives while torch is still importing must already be caught
(SIGUSR1's default action would kill the rank without a checkpoint).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

COALESCE_S = 5.0
PR_SET_PDEATHSIG = 1
GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)


class _State:
    signalled: bool = False  # a scheduler signal asked for a graceful stop
    since: float | None = None  # when a graceful stop was first asked (signal or control)
    signum: int | None = None


_state = _State()


def _on_signal(signum: int, frame) -> None:
    now = time.monotonic()
    if _state.since is None:
        _state.since = now
        _state.signalled = True
        _state.signum = signum
        return
    _state.signalled = True
    if signum == signal.SIGTERM and now - _state.since > COALESCE_S:
        os._exit(128 + signum)  # a repeated SIGUSR1 is the same warning, never "leave now"


def install() -> None:
    for sig in GRACEFUL:
        signal.signal(sig, _on_signal)


def signalled() -> bool:
    return _state.signalled


def stopping() -> None:
    """A graceful stop is under way (a control ``stop``): a later signal escalates."""
    if _state.since is None:
        _state.since = time.monotonic()


def reset() -> None:  # for unit tests
    _state.signalled, _state.since, _state.signum = False, None, None


def die_with_parent() -> None:
    """Ask the kernel to kill this worker when its torchrun agent dies.

    torchrun starts each worker in a session of its own, so killing the agent (or the
    supervisor above it) would otherwise leave workers training as orphans.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's sweep still applies
        return
    if _orphaned(os.getppid()):  # the agent died before prctl took effect
        os._exit(1)


def _orphaned(ppid: int) -> bool:
    """Reparented to init, or to the supervisor (a subreaper) after torchrun's death."""
    if ppid == 1:
        return True
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            return b"gpu_console.supervisor" in f.read()
    except OSError:
        return False
