"""Attaching to a run that no console ever watched shows its device history: the supervisor
recorded it. A real headless run (2 CPU ranks) whose supervisor takes the fake NVML of
tests/nvml_run_fake.py (two GPUs, held by the two ranks) through ``GPU_CONSOLE_FAKE_NVML``."""

from __future__ import annotations

import os

import pytest
from conftest import REPO, Procs, only_run, paced_profile
from conftest import test_env as cli_env
from test_telemetry_fake import FakeNvml, install
from tui_support import screen_text, until

from gpu_console.state import gpu_figures
from gpu_console.telemetry.figures import describe
from gpu_console.tui.app import ConsoleApp
from gpu_console.tui.screens.run import RunScreen

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def headless_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("headless")
    runs = tmp / "runs"
    procs = Procs(runs)
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = cli_env(GPU_CONSOLE_FAKE_NVML="nvml_run_fake:two_gpus", PYTHONPATH=path)
    try:
        # Paced (3 s at least): the ranks live for several of the supervisor's ticks, so each
        # rank's history has two samples or more however fast the machine and the start-up.
        profile = paced_profile(tmp, max_steps=60)
        done = procs.cli(
            "run", str(profile), "--headless", "--devices", "cpu:2", "--runs-dir", str(runs),
            cwd=tmp, env={**env, "PACE_S": "0.05"},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        yield only_run(runs)
    finally:
        procs.cleanup()


async def test_attach_shows_the_device_history_of_an_ended_headless_run(headless_run, monkeypatch):
    import pynvml

    # This console has no GPU to sample: whatever it shows, it read from telemetry.jsonl.
    fake = install(monkeypatch, FakeNvml(2, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    app = ConsoleApp(runs_dir=headless_run.parent, run_dir=headless_run, refresh_s=0.05)
    async with app.run_test(size=(110, 36)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen), 10, "the run screen")
        screen = app.screen
        await until(pilot, lambda: screen.snapshot and screen.snapshot.devices.gpus, 10, "figures")
        await pilot.pause()
        view = screen.snapshot.devices
        assert screen.snapshot.state == "finished"
        assert view.source == "file" and view.note == ""
        assert fake.calls["nvmlDeviceGetCount"] == 0  # nothing sampled here
        # Each rank's CPU and RSS history, as the supervisor sampled it while the run ran.
        cards = {c.title: c for c in view.cards}
        assert set(cards) == {"rank 0", "rank 1"}
        for card in cards.values():
            assert len(card.history["rss"]) >= 2 and all(v > 0 for v in card.history["rss"])
        # What each GPU did over the run, the same figures as ls --json and the summary.
        assert list(view.gpus) == gpu_figures(headless_run)
        text = screen_text(app)
        for fig in view.gpus:
            line = f"GPU {fig['index']} {fig['name']}   run: {describe(fig, False, short=True)}"
            assert line in text
        assert "util 87 %" in text and "util 55 %" in text
        assert "no device samples" not in text
        await pilot.press("q")
