"""The ``gpu-console`` command's first lines: nothing here may import more than the stdlib.

``run`` holds the scheduler's signals from the process's first line (:mod:`.held_signals`):
on SLURM a ``--signal`` or ``scancel --signal`` may come while the command still imports
and checks, before the run's supervisor exists, and must end in a checkpoint and a requeue
rather than the death of the job's one task."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        from .held_signals import hold

        hold()
    from .cli import main as cli_main

    cli_main()
