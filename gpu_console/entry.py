"""The ``gpu-console`` command's first lines: nothing here may import more than the stdlib.

``run`` holds the scheduler's signals from the process's first line (:mod:`.held_signals`):
on SLURM a ``--signal`` or ``scancel --signal`` may come while the command still imports
and checks, before the run's supervisor exists, and must end in a checkpoint and a requeue
rather than the death of the job's one task."""

from __future__ import annotations

import sys

# The options the command group takes before a command, and whether each takes a value
# (cli.py's root callback): ``gpu-console --runs-dir DIR run ...`` is a run too.
GROUP_OPTIONS = {"--runs-dir": True, "--version": False, "-h": False, "--help": False}


def command_of(args: list[str]) -> str | None:
    """The command ``args`` (the process's arguments after its name) name, past the group's
    options; None when there is none."""
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name not in GROUP_OPTIONS:
            return None if arg.startswith("-") else arg
        i += 2 if GROUP_OPTIONS[name] and "=" not in arg else 1
    return None


def main() -> None:
    if command_of(sys.argv[1:]) == "run":
        from .held_signals import hold

        hold()
    from .cli import main as cli_main

    cli_main()
