"""The run screen's checkpoint panel lists what is on disk (what keep_last left, LATEST
marked), and follows the directory as checkpoints are written and pruned."""

from __future__ import annotations

import json
import os
import re

import pytest
import synthetic
import torch
from tui_support import until

from gpu_console.engine import checkpoint
from gpu_console.events import EventWriter
from gpu_console.runs import list_checkpoints
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.feed import RunFeed
from gpu_console.tui.screens.run import RunScreen
from gpu_console.tui.widgets.checkpoints import checkpoints_text

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def on_disk(run) -> list[tuple[int, bool]]:
    """(step, named by LATEST) of every complete checkpoint, newest first, read from disk."""
    ckpts = run / "checkpoints"
    latest = (ckpts / "LATEST").read_text().strip()
    steps = [p for p in ckpts.glob("step-*") if (p / "meta.json").is_file()]
    return sorted(((int(p.name[5:]), p.name == latest) for p in steps), reverse=True)


def panel(app) -> list[tuple[int, bool]]:
    """(step, marked LATEST) of each row of the panel, top to bottom."""
    text = str(app.screen.query_one("#checkpoints").render())
    rows = [re.match(r"(▶?)[★ ]?\s*([\d,]+) ", line) for line in text.splitlines()]
    return [(int(m.group(2).replace(",", "")), m.group(1) == "▶") for m in rows if m]


@pytest.mark.asyncio
async def test_the_panel_lists_the_checkpoints_keep_last_left(recorded_run):
    # quickstart: an interval every 100 steps, keep_last = 2; its events announce 100, 200
    # and 300, its checkpoints/ holds 200 and 300.
    announced = [e["step"] for e in map(json.loads, (recorded_run / "events.jsonl").open())
                 if e["kind"] == "checkpoint"]  # fmt: skip
    assert announced == [100, 200, 300]
    assert on_disk(recorded_run) == [(300, True), (200, False)]
    app = ConsoleApp(runs_dir=recorded_run.parent, run_dir=recorded_run, telemetry=False,
                     refresh_s=0.05)  # fmt: skip
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot,
                    10, "the first snapshot")  # fmt: skip
        await pilot.pause()
        assert panel(app) == on_disk(recorded_run)
        text = str(app.screen.query_one("#checkpoints").render())
        assert "end" in text.splitlines()[0] and "interval" in text.splitlines()[1]


def _write(run, step: int, keep_last: int) -> None:
    """A checkpoint written (and older ones pruned) by the engine's own writer, then its event."""
    state = {"model": {"w": torch.zeros(4)}, "step": step}
    event = checkpoint._write(run / "checkpoints", step, "interval", state, [{}], keep_last)
    out = EventWriter(run / "events.jsonl")
    try:
        out.emit("checkpoint", **event, seconds=0.01)
    finally:
        out.close()


@pytest.mark.asyncio
async def test_the_panel_follows_writes_and_prunes_of_a_live_run(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "live-20270101-000000", state="running",
                              steps=300, max_steps=1000, keep_last=2,
                              supervisor_pid=os.getpid())  # fmt: skip
    assert on_disk(run) == [(300, True), (200, False)]
    app = ConsoleApp(runs_dir=run.parent, run_dir=run, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot,
                    10, "the first snapshot")  # fmt: skip
        await until(pilot, lambda: panel(app) == on_disk(run), 10, "the panel")
        _write(run, 400, keep_last=2)  # 200 pruned
        assert on_disk(run) == [(400, True), (300, False)]
        await until(pilot, lambda: panel(app) == on_disk(run), 10, "the panel after a prune")


def test_the_feed_sees_a_changed_directory_without_an_event(tmp_path):
    # A directory that changed (a checkpoint written by a session whose events are elsewhere,
    # a prune): its mtime says so; the listing is read again only then.
    run = synthetic.write_run(tmp_path / "r", state="finished", steps=300, keep_last=3)
    feed = RunFeed(run, telemetry=False)
    feed.load()
    assert [c["step"] for c in feed.snapshot().checkpoints] == [100, 200, 300]
    assert [c["latest"] for c in feed.snapshot().checkpoints] == [False, False, True]
    assert feed.snapshot().checkpoints[-1]["reason"] == "end"  # the engine's last: end
    assert [c["step"] for c in list_checkpoints(run, newest=2)] == [200, 300]
    checkpoint.prune(run / "checkpoints", 1)
    os.utime(run / "checkpoints", ns=(1, 1))  # a new mtime, whatever the clock's resolution
    assert feed.poll()
    assert [c["step"] for c in feed.snapshot().checkpoints] == [300]
    assert not feed.poll()  # nothing changed: nothing read


def test_the_best_checkpoint_is_listed_however_old_and_marked(tmp_path):
    # keep_best keeps BEST beside the newest ones; the panel reads only the newest N
    # directories, and still lists (and stars) the best one.
    run = tmp_path / "run"
    for step in (100, 200, 300, 400, 500):
        checkpoint._write(run / "checkpoints", step, "interval", {"step": step}, [{}], 0)
    (run / "checkpoints" / "BEST").write_text("step-00000200\n")
    found = list_checkpoints(run, newest=2)
    assert [(c["step"], c["latest"], c["best"]) for c in found] == [
        (200, False, True),
        (400, False, False),
        (500, True, False),
    ]
    rows = str(checkpoints_text(found, now=0.0)).splitlines()
    assert [r[:2] for r in rows] == ["▶ ", "  ", " ★"]
    assert rows[2].split()[1] == "200"
