"""The run screen's failure panel names whoever failed: here torchrun itself, for real."""

from __future__ import annotations

import os
import re

import pytest
from conftest import fast_profile, only_run
from conftest import test_env as cli_env
from test_torchrun_compat import installed_options, seed_cache
from tui_support import screen_text, until

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.run import RunScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


async def test_a_torchrun_that_rejects_a_flag_is_named_in_the_failure_panel(
    procs, runs_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    options = installed_options()
    options["monitor_interval"] = ["--no-such-flag"]  # the detection says torchrun takes it
    seed_cache(options)
    ran = procs.cli(
        "run", str(fast_profile(tmp_path)), "--headless", "--runs-dir", str(runs_dir),
        env=cli_env(XDG_CACHE_HOME=os.environ["XDG_CACHE_HOME"]),
    )  # fmt: skip
    assert ran.returncode == 1, ran.stdout + ran.stderr
    run = only_run(runs_dir)
    app = ConsoleApp(runs_dir=runs_dir, run_dir=run, telemetry=False, refresh_s=0.05)
    async with app.run_test(size=(110, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot, 10,
                    "the first snapshot")  # fmt: skip
        await until(pilot, lambda: app.screen.has_class("-failed"), 10, "the failure panel")
        await pilot.pause()
        text = screen_text(app)
        assert "FAILED" in text and "torchrun  exit code 2" in text, text
        # The value is launch's monitor interval, whatever it is: the flag's name is the point.
        rejected = r"torchrun: error: unrecognized arguments: --no-such-flag=[\d.]+"
        assert re.search(rejected, text), text
        assert "rank ?" not in text and "logs/torchrun.log" in text, text
        await pilot.press("q")
    assert app.return_code == 1
