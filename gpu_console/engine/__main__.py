"""``python -m gpu_console.engine RUN_DIR``: one rank of a run (started by torchrun).

Order matters: the scheduler-signal handlers and the heartbeat come first, before torch is
imported (seconds), so a SIGTERM/SIGUSR1 that arrives while the rank starts is a graceful
stop, not a death.

What belongs to the whole process is set here, not by the loop: the signal handlers, the
CPU rank's cores and threads, and determinism (:func:`process_setup`). ``loop.train`` runs in
any process that has a process group (tests/harness.py runs it in pytest's own), and leaves
such a process as it found it.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from .. import held_signals, network
from ..devices import RANK_DEVICES
from ..frozen_imports import frozen_imports
from ..timings import Stopwatch
from . import signals
from .heartbeat import Heartbeat


def main(argv: list[str]) -> None:
    watch = Stopwatch()
    watch.mark("rank")
    signals.die_with_parent()
    signals.install()
    held_signals.release()  # torchrun started this rank with SIGUSR1 held (held_signals.py)
    run_dir = Path(argv[0])
    heartbeat = Heartbeat(
        run_dir,
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        restart=restart_count(),
    )
    # The profile's distributed.env, before torch is imported: NCCL and gloo read them from
    # this process's environment (each node reads its own run.toml, the same profile).
    network.apply(run_dir / "run.toml")
    own_device()
    imports_without_gc()
    # torchelastic's @record writes this rank's exception (message, traceback) to the error
    # file torchrun names; the supervisor reads it to say which rank failed and why.
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(run_rank)(run_dir, heartbeat, watch)
    except BaseException:
        heartbeat.close("failed")
        raise
    heartbeat.close("done")
    # The rank's work is done and recorded, and its process group destroyed. Leave without
    # the interpreter's teardown: there, about one process in ten here aborted in a C++ static
    # destructor ("terminate called without an active exception", torch 2.13 + gloo), which
    # torchrun reports as a failed rank and the supervisor as a failed run. What a normal exit
    # does for the user's code still happens: its atexit handlers (a TensorBoard or W&B
    # finaliser, a profiler's export) and logging's flush (itself an atexit handler) run
    # first; the abort was in C++ destructors, which run after them.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def imports_without_gc() -> None:
    """torch, its compiler and the engine imported as :mod:`..frozen_imports` says (about a
    fifth of a rank's start-up CPU saved)."""
    with frozen_imports():
        import torch.distributed.elastic.multiprocessing.errors  # noqa: F401

        from . import loop  # noqa: F401
        from .torch_private import import_compiler

        import_compiler()


def own_device() -> None:
    """MIG instances: CUDA shows a process one of them, so each rank's mask names its own
    (devices.Placement.per_rank), set before torch starts CUDA."""
    devices = os.environ.get(RANK_DEVICES, "")
    if devices:
        mine = devices.split(",")[int(os.environ.get("LOCAL_RANK", 0))]
        os.environ["CUDA_VISIBLE_DEVICES"] = mine


def restart_count() -> int:
    """How many times torchrun has restarted the worker group (``distributed.max_restarts``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def process_setup(profile, device_type: str) -> None:
    """Once per rank process, before the process group: CPU placement (cores and threads),
    then determinism, before anything touches CUDA."""
    from . import determinism
    from .distributed import place_process

    place_process(profile.distributed, device_type)
    determinism.setup(profile.train.deterministic)


def run_rank(
    run_dir: Path, heartbeat: Heartbeat | None, watch: Stopwatch, setup=process_setup
) -> None:
    """The rank's run from its run directory; ``setup``: what the process sets for itself
    (:func:`process_setup`; the harness's own, which restores what it changed)."""
    from ..profile import load_profile, with_task_config
    from ..runs import current_session, read_json
    from ..tasks.loader import load_task_class
    from .loop import train

    meta = current_session(read_json(run_dir / "meta.json") or {})  # this session's facts
    # A user's task module is found from where the run was launched, like `python -m`.
    if meta.get("cwd") and meta["cwd"] not in sys.path:
        sys.path.insert(0, meta["cwd"])
    profile = load_profile(str(run_dir / "run.toml"))
    task_cls = load_task_class(profile.task_kind)
    profile = with_task_config(profile, task_cls.Config, str(run_dir / "run.toml"))
    watch.session = meta
    watch.mark("imports")
    device_type = meta.get("placement", {}).get("device_type", "cpu")
    setup(profile, device_type)
    resume = meta.get("resume_from")
    train(
        run_dir,
        profile,
        task_cls(profile.task),
        device_type,
        Path(resume) if resume else None,
        heartbeat=heartbeat,
        restart=restart_count(),
        changes=meta.get("changes") or [],
        stopwatch=watch,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m gpu_console.engine RUN_DIR", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1:])
