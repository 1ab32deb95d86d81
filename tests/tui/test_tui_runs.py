"""The runs screen (``r`` from anywhere): runs with `ls`'s columns; Enter attaches."""

from __future__ import annotations

import pytest
import synthetic
from tui_support import screen_text, until

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.launch import LaunchScreen
from gpu_console.tui.screens.modals import DiffScreen
from gpu_console.tui.screens.run import RunScreen
from gpu_console.tui.screens.runs import RunsScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


def _two_runs(tmp_path):
    """A failed run and, an hour later, a finished one: (runs directory, old, new)."""
    runs = tmp_path / "runs"
    old = synthetic.write_run(runs / "old-20260101-000000", state="failed", steps=120)
    new = synthetic.write_run(runs / "new-20260102-000000", state="finished", steps=300,
                              t0=synthetic.T0 + 3600)  # fmt: skip
    return runs, old, new


async def test_r_lists_the_runs_and_enter_attaches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs, old, new = _two_runs(tmp_path)
    app = ConsoleApp(runs_dir=runs, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
        await pilot.press("r")
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        await until(pilot, lambda: screen.listed, 5, "the list")
        await pilot.pause()
        assert [r["name"] for r in screen.rows] == [new.name, old.name]  # newest first
        text = screen_text(app)
        assert "finished" in text and "failed" in text and "300/300" in text
        assert "120/120" in text
        # The columns say what they measure, as `ls` does: begun and last moved, not "age".
        table = screen.query_one("#runs")
        assert [str(c.label) for c in table.columns.values()] == [
            "run", "state", "step", "loss", "started", "updated"
        ]  # fmt: skip
        assert text.count(" ago") >= 4
        await pilot.press("down", "enter")  # the older, failed one
        await until(pilot, lambda: isinstance(app.screen, RunScreen), 5, "the run screen")
        run = app.screen
        assert run.run_dir == old
        await until(pilot, lambda: run.snapshot and run.snapshot.state == "failed", 5, "loaded")
        # From a run, r and Enter switch to another run.
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RunsScreen) and app.screen.listed, 5,
                    "the list again")  # fmt: skip
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.run_dir == new,
                    5, "the other run")  # fmt: skip
        assert len([s for s in app.screen_stack if isinstance(s, RunScreen)]) == 1


async def test_an_empty_runs_directory_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = ConsoleApp(runs_dir=tmp_path / "nothing-here", telemetry=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
        await pilot.press("r")
        await until(pilot, lambda: app.screen.listed, 5, "the list")
        await pilot.pause()
        assert "no runs under" in screen_text(app)
        await pilot.press("escape")
        assert isinstance(app.screen, LaunchScreen)


async def test_space_marks_two_runs_and_x_compares_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs, old, new = _two_runs(tmp_path)
    app = ConsoleApp(runs_dir=runs, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(110, 34)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
        await pilot.press("r")
        screen = app.screen
        await until(pilot, lambda: screen.listed, 5, "the list")
        await pilot.press("x")  # nothing marked: it says what to do
        await until(pilot, lambda: any("mark two runs" in str(n.message)
                                       for n in app._notifications), 5, "the hint")  # fmt: skip
        await pilot.press("space", "down", "space")
        assert screen.marked == [str(new), str(old)]
        await until(pilot, lambda: screen_text(app).count("● ") == 2, 5, "both marks shown")
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, DiffScreen), 10, "the comparison")
        await until(pilot, lambda: "profile: what differs" in screen_text(app), 5, "drawn")
        text = screen_text(app)
        assert "train.max_steps" in text  # 300 against 120: their run.toml differ there
        assert "finished" in text and "failed" in text and "300/300" in text
        await pilot.press("escape")
        assert app.screen is screen
        await pilot.press("space")  # the cursor's run again: unmarked
        assert screen.marked == [str(new)]


async def test_a_run_without_run_toml_is_listed_damaged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs, old, new = _two_runs(tmp_path)
    (old / "run.toml").unlink()  # half-deleted: listed as ls lists it, not hidden
    app = ConsoleApp(runs_dir=runs, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the launch screen")
        await pilot.press("r")
        await until(pilot, lambda: app.screen.listed, 5, "the list")
        await pilot.pause()
        assert [r["name"] for r in app.screen.rows] == [new.name, old.name]
        text = screen_text(app)
        assert "failed (damaged)" in text and "finished (damaged)" not in text
