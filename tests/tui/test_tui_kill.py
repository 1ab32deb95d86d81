"""The run screen's kill (``k``, then ``y``) on a real run this console launched: the run ends
``killed`` with no checkpoint and no failure shown, and the console exits 137, the number
status.json holds."""

from __future__ import annotations

import pytest
from conftest import events_of, fast_profile, read_status
from tui_support import kill_runs, screen_text, until

from gpu_console import launch
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.modals import ConfirmScreen
from gpu_console.tui.screens.run import RunScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


async def test_k_then_y_kills_the_run_it_launched(tmp_path):
    runs = tmp_path / "runs"
    profile, placement, _ = launch.prepare(
        str(fast_profile(tmp_path, max_steps=1_000_000)), runs_dir=runs
    )
    launched = launch.start(profile, placement, runs)
    app = ConsoleApp(
        runs_dir=runs,
        run_dir=launched.run_dir,
        owner=True,
        supervisor=launched.supervisor,
        refresh_s=0.05,
        telemetry=False,
    )
    try:
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, RunScreen), 10, "the run screen")
            screen = app.screen
            await until(pilot, lambda: screen.snapshot and screen.snapshot.step > 0, 90, "a step")
            await pilot.press("k")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: screen.snapshot.state == "killed", 30, "killed shown")
            await until(pilot, lambda: read_status(launched.run_dir).get("ended"), 30, "the end")
            status = read_status(launched.run_dir)
            assert (status["state"], status["exit_code"]) == ("killed", 137)
            assert "failure" not in status and events_of(launched.run_dir, "checkpoint") == []
            text = screen_text(app)
            assert "killed" in text and "FAILED" not in text
            assert "SignalException" not in text and "Traceback" not in text
            assert not screen.has_class("-failed")
            await pilot.press("q")  # ended: quits at once, with the run's exit code
        assert app.return_code == 137
        assert launched.supervisor.wait(30) == 137
    finally:
        kill_runs(runs)
