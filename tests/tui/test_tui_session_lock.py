"""The run screen's keys write only to a run a session holds (its lock, gpu_console.session_lock):
a command to a run nobody runs is never appended, and the screen says why."""

from __future__ import annotations

import pytest
from test_tui_run import app_on, loaded
from tui_support import control_lines, fake_live_fixture, screen_text, until  # noqa: F401

from gpu_console.session_lock import take

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


async def test_a_command_to_a_run_no_session_holds_is_not_sent(fake_live):
    run = fake_live.run_dir
    (run / ".lock").touch(mode=0o600)  # a lock file nobody holds: no session reads commands
    app = app_on(run)
    async with app.run_test(size=(100, 32)) as pilot:
        await loaded(pilot, app)
        await pilot.press("c")
        # (the log wraps the line: its first words are enough)
        await until(pilot, lambda: "no session is running" in screen_text(app), 10, "the refusal")
        assert control_lines(run) == []

        with take(run, "run"):  # a session holds it: the command goes
            await pilot.press("c")
            await until(pilot, lambda: "checkpoint ✓ done" in screen_text(app), 10, "the ack")
        assert [c["cmd"] for c in control_lines(run)] == ["checkpoint"]
