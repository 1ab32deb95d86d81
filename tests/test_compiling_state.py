"""The ``compiling`` state (train.compile's first step) as every reader shows it.

The engine writes ``status: compiling`` with ``since`` before its first step and ``running``
once that step completes: status.json carries ``compiling_since``, the headless bar and the
run header show the seconds so far, and a minute without a step is no stall.
"""

from __future__ import annotations

import json
import os

import pytest
import synthetic

from gpu_console.fold import RunFold, derived_state
from gpu_console.headless import _notable
from gpu_console.tui.feed import RunFeed
from gpu_console.tui.widgets.header import header_text

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

T0 = synthetic.T0


def _compiling(run):
    """A live run whose engine began compiling at T0 + 10 and has made no step since."""
    synthetic.write_run(run, steps=0, max_steps=50, state="running", supervisor_pid=os.getpid())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    events = [e for e in events if e["kind"] not in ("step", "eval", "checkpoint")]
    events = [e for e in events if not (e["kind"] == "status" and e["state"] != "starting")]
    events.append(
        {"v": 1, "t": T0 + 10, "kind": "status", "state": "compiling",
         "reason": "torch.compile mode default", "since": T0 + 10}
    )  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return events


def test_compiling_is_a_state_with_its_seconds_and_never_a_stall(tmp_path):
    events = _compiling(tmp_path / "run")
    fold = RunFold()
    for e in events:
        fold.apply(e)
    status = {**fold.to_status(), "pids": {"supervisor": os.getpid()}}
    assert status["state"] == "compiling" and status["compiling_since"] == T0 + 10
    # Ten minutes in, no step at all: still compiling, not stalled.
    assert derived_state(status, T0 + 610) == "compiling"

    # status.json as the supervisor writes it: its fields, the fold's state.
    path = tmp_path / "run" / "status.json"
    written = json.loads(path.read_text())
    for key in ("last_step_t", "step_time_s", "step", "loss"):
        written.pop(key, None)
    path.write_text(json.dumps({**written, **fold.to_status()}))

    feed = RunFeed(tmp_path / "run", clock=lambda: T0 + 52, telemetry=False)
    feed.load()
    text = header_text(feed.snapshot()).plain
    assert " compiling  42 s" in text, text

    fold.apply({"v": 1, "t": T0 + 70, "kind": "status", "state": "running",
                "reason": "compiled", "compiled_s": 60.0})  # fmt: skip
    assert fold.to_status()["compiling_since"] is None


def test_the_headless_console_says_when_compiling_begins_and_ends():
    from rich.console import Console

    console = Console(width=200, record=True)
    _notable({"kind": "status", "state": "compiling", "reason": "torch.compile mode default"},
             console)  # fmt: skip
    _notable({"kind": "status", "state": "running", "reason": "compiled", "compiled_s": 61.25},
             console)  # fmt: skip
    lines = console.export_text().splitlines()
    assert lines == [
        "compiling the model (torch.compile mode default): the first step waits for it",
        "compiled in 61.2 s",
    ]
