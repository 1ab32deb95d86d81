"""What ``gpu-console run --headless`` prints for a finished run, made from its directory.

A harness run (tests/harness.py) has no console attached; a test that checks a line the
headless console derives from the engine's events (the start line's strategy, a task's log
line, the summary's train metrics and activation checkpointing row) reads it here, from the
console's own functions over the run's events. The console's following of a live run is
tested through the CLI (tests/test_output.py, tests/test_engine.py and others).
"""

from __future__ import annotations

from pathlib import Path


def headless_text(run_dir: Path) -> str:
    """The event lines and the summary the headless console prints off a terminal (its
    progress beats left out: they depend on the clock)."""
    import io

    from rich.console import Console

    from gpu_console.headless import _notable
    from gpu_console.state import RunFollower
    from gpu_console.summary import print_summary

    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    follower = RunFollower(run_dir)
    for e in follower.poll():
        _notable(e, console)
    print_summary(console, follower.state, run_dir)
    return out.getvalue()
