"""SVG snapshots of the launch and run screens: fixed data, a fixed clock, fixed colours
(hex values in code), GPUs through the fake-NVML seam. Refresh them after a meant change
with ``GPU_CONSOLE_UPDATE_SNAPSHOTS=1 python -m pytest tests/tui -k snapshot``."""

from __future__ import annotations

import pytest
import synthetic
from test_telemetry_fake import FakeGpu, FakeNvml, install
from tui_support import assert_svg, picture_telemetry, screen_text, until

from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.launch import LaunchScreen
from gpu_console.tui.screens.run import RunScreen

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]
GIB = 2**30


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(0, name="NVIDIA A100-SXM4-80GB", memory_used=2 * GIB, util_gpu=3),
            FakeGpu(1, name="NVIDIA A100-SXM4-80GB", memory_used=2 * GIB, util_gpu=0),
        ]
    )


async def test_snapshot_launch_screen(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpu_console.devices.default_cpu_ranks", lambda: 2)
    install(monkeypatch, two_gpus())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing restricts the GPUs: both are yours
    app = ConsoleApp(runs_dir=tmp_path / "runs", devices_every_s=3600)
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LaunchScreen), 5, "the screen")
        screen = app.screen
        await until(pilot, lambda: screen.preview and screen._devices_ready, 10, "the data")
        await pilot.pause()
        assert_svg(app, "launch")


async def test_snapshot_run_screen_with_gpu_cards(tmp_path, monkeypatch):
    fake = install(monkeypatch, two_gpus())
    run = synthetic.write_run(tmp_path / "runs" / "transformer-20270115-093000",
                              steps=1800, max_steps=2000, log_every=20, eval_every=200,
                              checkpoint_every=500, device_type="cuda", precision="bf16",
                              task="transformer", samples_per_s=5200.0, tokens_per_s=332_800.0,
                              step_s=0.19)  # fmt: skip
    picture_telemetry(run, fake)
    app = ConsoleApp(runs_dir=run.parent, run_dir=run, clock=lambda: synthetic.T0 + 400)
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen), 5, "the screen")
        screen = app.screen
        await until(pilot, lambda: screen.snapshot and screen.snapshot.devices.cards, 10, "cards")
        # The footer's keys may come a frame after the snapshot on a busy machine.
        await until(pilot, lambda: "report" in screen_text(app), 10, "the footer's keys")
        # The ranks' log lines are read by a worker after the events: on a loaded machine
        # (CI's) the screen was once taken between the two.
        await until(pilot, lambda: "synthetic warning for the log pane" in screen_text(app), 10,
                    "the ranks' log lines")  # fmt: skip
        await pilot.pause()
        assert "A100" in str(screen.query_one("#devices").render())
        assert_svg(app, "run-gpu")


async def test_snapshot_failed_run_at_80x24(tmp_path):
    run = synthetic.write_run(tmp_path / "runs" / "quickstart-20270115-101500", state="failed",
                              steps=120)  # fmt: skip
    app = ConsoleApp(runs_dir=run.parent, run_dir=run, clock=lambda: synthetic.T0 + 60,
                     telemetry=False)  # fmt: skip
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen), 5, "the screen")
        screen = app.screen
        await until(pilot, lambda: screen.has_class("-failed"), 10, "the failure")
        await until(pilot, lambda: "a synthetic warning" in screen_text(app), 10,
                    "the ranks' log lines")  # fmt: skip
        await pilot.pause()
        assert_svg(app, "run-failed-80x24")
