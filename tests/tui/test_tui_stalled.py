"""The run screen on a run whose rank froze: ``stalled`` naming the rank, and its stop
dialog says a graceful stop may never come and names the kill."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from tui_support import fake_live_fixture, screen_text, until  # noqa: F401 - fixtures

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.modals import ConfirmScreen
from gpu_console.tui.screens.run import RunScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


async def test_a_frozen_rank_is_stalled_and_the_stop_dialog_says_so(fake_live, monkeypatch):
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", "5")
    beats = fake_live.run_dir / "heartbeats"
    beats.mkdir()
    # Rank 1's process lives (this one) but its heartbeat has been silent for 60 s.
    beat = {"rank": 1, "pid": os.getpid(), "host": socket.gethostname(), "phase": "starting"}
    (beats / "rank-00001.json").write_text(json.dumps({**beat, "t": time.time() - 60}))
    # The synthetic run starts at a fixed clock ahead of today's: this session began earlier.
    status = json.loads((fake_live.run_dir / "status.json").read_text())
    status["started"] = time.time() - 120
    (fake_live.run_dir / "status.json").write_text(json.dumps(status))
    app = ConsoleApp(runs_dir=fake_live.run_dir.parent, run_dir=fake_live.run_dir,
                     telemetry=False, refresh_s=0.05)  # fmt: skip
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot,
                    10, "the first snapshot")  # fmt: skip
        screen = app.screen
        await until(pilot, lambda: screen.snapshot.state == "stalled", 10, "stalled")
        assert "rank 1 (no heartbeat for" in screen.snapshot.reason
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen)
        body = app.screen.body
        assert "stalled" in body and "k kills it now" in body
        await pilot.press("n")
