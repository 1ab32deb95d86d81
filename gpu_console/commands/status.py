"""``status RUN [--json]``: one run's summary, running or ended, from its directory alone.

The text is the headless console's end summary (:mod:`gpu_console.summary`); the JSON is the
run's ``ls --json`` entry with the summary's fields added. The state is the one ``ls`` shows
(``lost`` and ``stalled`` included), so the two commands never disagree about a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import strict_json
from ..lost import settle
from ..runs import find_run
from ..state import RunFollower
from ..summary import summary_fields
from .runs import json_row, run_rows


def status(run_arg: str, runs_dir: Path) -> tuple[Path, RunFollower, dict[str, Any]]:
    """The run, its events folded (with the state ``ls`` shows) and its ``ls`` row."""
    run = find_run(run_arg, runs_dir)
    (row,) = run_rows([run])
    follower = RunFollower(run)
    follower.poll()
    st = follower.state
    # status.json as ``ls`` settled it (repaired, or derived where the run directory cannot
    # be written: the file there may still be damaged), its end and wall time included.
    st.apply_status(settle(run))
    st.state, st.reason = row["state"], row["reason"]
    if not st.events:
        # No events to fold (events.jsonl deleted, or none written yet): status.json's
        # figures are all the run directory still holds, and what ``ls`` shows.
        st.step = row["step"] if isinstance(row["step"], int) else st.step
        st.max_steps = row["max_steps"] if isinstance(row["max_steps"], int) else st.max_steps
        st.loss, st.best_loss = row["loss"], row["best_loss"]
    return run, follower, row


def to_json(run: Path, follower: RunFollower, row: dict[str, Any]) -> dict[str, Any]:
    """The ``ls --json`` entry, then the summary's fields; where the entry knows nothing (a
    run that failed before its first step has no ``max_steps`` in status.json) the
    summary's value, read from run.toml, stands."""
    out = json_row(row)
    for key, value in summary_fields(follower.state, run).items():
        if out.get(key) is None:
            out[key] = value
    return out


def main(run_arg: str, runs_dir: Path, as_json: bool) -> int:
    run, follower, row = status(run_arg, runs_dir)
    if as_json:
        print(strict_json.dumps(to_json(run, follower, row), indent=2))
        return 0
    from rich.console import Console

    from ..format import uncut
    from ..summary import print_summary

    print_summary(uncut(Console()), follower.state, run)
    return 0
