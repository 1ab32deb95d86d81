"""The sweep screen (``gpu-console sweep`` on a terminal): a row per trial from the sweep's
own files, the best starred; its keys write the driver's commands; Enter opens a trial's run.
What the driver does with those commands is checked on a real Driver below, in-process."""

from __future__ import annotations

import json

import pytest
import synthetic
from tui_support import screen_text, until

from gpu_console.sweep import store
from gpu_console.sweep.driver import Driver
from gpu_console.sweep.slots import Slot
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.run import RunScreen
from gpu_console.tui.screens.sweep import SweepScreen

pytestmark = pytest.mark.quick


def _sweep(tmp_path):
    """A sweep of three trials: 0 finished (a real run directory), 1 running, 2 pending."""
    sweep_dir = tmp_path / "runs" / "lr-20261129-120000"
    sweep_dir.mkdir(parents=True)
    trials = [{"train.lr": lr} for lr in (0.001, 0.003, 0.01)]
    plan = {
        "version": 1,
        "sweep": {"name": "lr", "profile": "quickstart", "search": "grid", "trials": None,
                  "max_minutes": 0, "trial_devices": "cpu:1", "devices": "cpu:2", "seed": 0,
                  "parameters": ["train.lr"], "set": {}},
        "objective": {"metric": "eval.loss", "direction": "min", "use": "last"},
        "pruning": {"kind": "none", "startup_trials": 2, "warmup_evals": 0},
        "slots": [{"index": 0, "devices": "cpu:1", "cores": []},
                  {"index": 1, "devices": "cpu:1", "cores": []}],
        "params": [], "grid": 3,
        "trials": [{"trial": n, "params": p, "sets": []} for n, p in enumerate(trials)],
    }  # fmt: skip
    store.write_plan(sweep_dir, plan)
    synthetic.write_run(sweep_dir / "trial-000", state="finished", steps=300)
    store.append_event(sweep_dir, "sweep", state="running", session="s1", pid=1, resumed=False)
    for n in (0, 1):
        store.append_event(sweep_dir, "trial", trial=n, state="started",
                           run=f"trial-{n:03d}", devices="cpu:1", step=0)  # fmt: skip
    store.append_event(sweep_dir, "trial", trial=0, state="finished", run="trial-000",
                       objective=0.4321, step=300)  # fmt: skip
    return sweep_dir


@pytest.mark.asyncio
async def test_the_sweep_screen_lists_the_trials_and_its_keys_ask_the_driver(tmp_path):
    sweep_dir = _sweep(tmp_path)
    app = ConsoleApp(runs_dir=sweep_dir, sweep_dir=sweep_dir, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(110, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, SweepScreen)
        await until(pilot, lambda: screen.read, 5, "the sweep read")
        await pilot.pause()
        text = screen_text(app)
        assert "sweep lr-20261129-120000  running  1/3 trials ended" in text
        assert "★ 0" in text and "0.4321" in text and "finished" in text
        assert "running" in text and "pending" in text and "0.003" in text
        assert "best: trial 0, eval.loss = 0.4321  (trial-000)" in text
        control = sweep_dir / store.CONTROL
        await pilot.press("p")  # trial 0 has ended: nothing to prune
        await pilot.pause()
        assert not control.exists()
        await pilot.press("down", "p", "s", "S")
        await pilot.pause()
        cmds = [json.loads(line) for line in control.read_text().splitlines()]
        assert [(c["cmd"], c.get("trial")) for c in cmds] == [
            ("prune", 1), ("stop_trial", 1), ("stop", None)
        ]  # fmt: skip
        await pilot.press("up", "enter")
        await until(pilot, lambda: isinstance(app.screen, RunScreen), 5, "trial 0's run")
        assert app.screen.run_dir == sweep_dir / "trial-000"
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen, 5, "back on the sweep screen")


def test_the_driver_prunes_and_stops_a_live_trial_as_asked(tmp_path):
    """The commands the screen writes, read by a real driver: a prune is recorded and the
    trial's run asked to stop; a stop_trial only asks the run; a trial not live is left."""
    sweep_dir = _sweep(tmp_path)
    run = synthetic.write_run(sweep_dir / "trial-001", state="finished", steps=10)
    driver = Driver(sweep_dir)
    driver.live = {1: (Slot(1, "cpu:1"), run, None)}
    store.append_control(sweep_dir, "prune", trial=1)
    store.append_control(sweep_dir, "stop_trial", trial=2)
    driver.read_control()
    asked = [json.loads(line)["cmd"] for line in (run / "control.jsonl").read_text().splitlines()]
    assert asked[-1:] == ["stop"]
    pruning = [e for e in store.read_events(sweep_dir) if e.get("state") == "pruning"]
    assert [(e["trial"], e["reason"]) for e in pruning] == [(1, "pruned by hand")]
    # trial 2 is not live: nothing recorded for it, the sweep itself not stopped
    assert not [e for e in store.read_events(sweep_dir) if e.get("trial") == 2]
    assert not driver.stop_asked
    # Its end, a stop with a checkpoint, is recorded as pruned.
    driver.record_end(1, run, {"state": "stopped", "step": 10})
    assert store.read_events(sweep_dir)[-1]["state"] == "pruned"
