"""The run screen on a run resumed in its own directory (real torchrun, 2 CPU ranks): one
run, one history, one loss chart across its sessions."""

from __future__ import annotations

import pytest
from conftest import deadline, events_of, fast_profile, the_run, wait_for
from tui_support import screen_text, until

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.run import RunScreen

pytestmark = pytest.mark.asyncio
LOG_EVERY = 7


async def test_attach_to_a_resumed_run_shows_every_session_on_one_chart(procs, runs_dir, tmp_path):
    log = f"train.log_every={LOG_EVERY}"
    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                          "--set", log)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 3, what="3 logged steps")
    stop = procs.cli("stop", str(run), "--runs-dir", str(runs_dir))
    assert stop.returncode == 0, stop.stderr
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    (ckpt,) = [c for c in events_of(run, "checkpoint") if c["reason"] == "stop"]
    stopped_at = ckpt["step"]
    end = stopped_at + 3 * LOG_EVERY
    resumed = procs.cli("run", "--resume", str(run), "--headless", "--runs-dir", str(runs_dir),
                        "--set", f"train.max_steps={end}", "--set", log)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert len(events_of(run, "start")) == 2
    logged = [e["step"] for e in events_of(run, "step")]
    assert logged[0] < stopped_at < logged[-1] == end

    app = ConsoleApp(runs_dir=runs_dir, run_dir=run, readonly=True, telemetry=False,
                     refresh_s=0.05)  # fmt: skip
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen.snapshot,
                    10, "the first snapshot")  # fmt: skip
        screen = app.screen
        chart = screen.query_one("#loss")
        await until(pilot, lambda: chart.lines, 10, "the loss line")
        await pilot.pause()
        s = screen.snapshot
        assert (s.state, s.step, s.max_steps) == ("finished", end, end)
        assert f"{end}/{end}" in screen_text(app)
        # One chart over both sessions: every logged step of the run, in order.
        assert [x for x, _ in s.loss_series.view()] == logged
        axis = str(chart.render()).splitlines()[-1]
        assert str(logged[0]) in axis and str(logged[-1]) in axis, axis
        assert [c["step"] for c in s.checkpoints if c["reason"] == "stop"] == [stopped_at]
        await pilot.press("q")
