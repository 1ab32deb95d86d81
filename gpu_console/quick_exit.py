"""``python -m gpu_console.quick_exit MODULE ARGS...``: ``python -m MODULE ARGS...``, then leave
without the interpreter's teardown.

The supervisor runs torchrun this way (``MODULE`` is ``torch.distributed.run``). A process that
imported torch spends a while tearing its modules down at exit: 0.2 s on an idle machine here,
1 to 2 s on a busy one; every run's end waited for it before the supervisor could record the
exit code. What a normal exit does for the program still happens, in the same order: non-daemon
threads are joined, atexit handlers run (logging's flush among them), stdout and stderr are
flushed; an uncaught exception prints its traceback and exits 1, ``SystemExit`` exits with its
code, and an uncaught KeyboardInterrupt ends the process by SIGINT. No torch here.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import runpy
import signal
import sys
import threading

from .frozen_imports import frozen_imports


def _finalize() -> None:
    """What the interpreter does first at exit: join non-daemon threads, run atexit."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()


def _leave(code: int) -> None:
    _finalize()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _import_package(module: str) -> None:
    """The module's package (for torchrun, torch) imported as :mod:`.frozen_imports` says. A
    package that does not import is left for runpy to report, as ``-m`` would."""
    package = module.rpartition(".")[0]
    if package:
        with frozen_imports(), contextlib.suppress(Exception):
            importlib.import_module(package)


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m gpu_console.quick_exit MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]  # runpy puts the module's path in argv[0], as -m does
    _import_package(module)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        _leave(_exit_code(e))
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _finalize()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(128 + signal.SIGINT)  # had the signal not ended it
    except BaseException:
        sys.excepthook(*sys.exc_info())
        _leave(1)
    _leave(0)


if __name__ == "__main__":
    main()
