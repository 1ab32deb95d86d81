"""Helpers and fixtures for the console's tests (imported by tests/tui/test_tui_*.py).

- :func:`until`: await a condition in a Pilot test, with a deadline (never a fixed sleep);
- :class:`FakeRun`: a live run without torch: a synthetic run directory, a stand-in
  supervisor process (ended by pid at teardown) and a thread that answers control.jsonl as
  the engine does (received → done, pause/resume/stop status events);
- ``recorded_run`` (tests/conftest.py): one real quickstart run, recorded once per session
  with ``--headless``;
- :func:`assert_svg`: SVG snapshots compared with tests/tui/snapshots/ (refresh them with
  ``GPU_CONSOLE_UPDATE_SNAPSHOTS=1``);
- :func:`picture_telemetry`: a telemetry.jsonl made through the fake-NVML seam.
"""

from __future__ import annotations

import difflib
import html
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import synthetic
import textual
from conftest import Procs, deadline, wait_for

from gpu_console.events import EventWriter, JsonlTail

SNAPSHOTS = Path(__file__).parent / "snapshots"


async def until(pilot, pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition"):
    """Let the app run until ``pred()`` is truthy; fail at the deadline (``timeout`` on a
    quiet machine, stretched as every test deadline is: conftest.deadline)."""
    timeout = deadline(timeout)
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await pilot.pause(0.05)


def screen_text(app) -> str:
    """Everything the screen shows, as plain text (what a person reads)."""
    from rich.console import Console

    console = Console(width=app.size.width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    lines = app.screen._compositor.render_update(full=True)
    console.print(lines)
    return console.export_text()


def control_lines(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "control.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- a live run without torch ------------------------------------------------------------------

SUPERVISOR = """
import pathlib, signal, sys, time
def on_signal(signum, frame):
    pathlib.Path(sys.argv[1], f"{signal.Signals(signum).name}-received").write_text("1")
    sys.exit(0)
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGUSR2, on_signal)  # the supervisor's kill on request
pathlib.Path(sys.argv[1], "supervisor-ready").write_text("1")
while True:
    time.sleep(0.05)
"""


class FakeRun:
    """A running run: steps every ``step_s``, control commands answered like the engine."""

    def __init__(self, run_dir: Path, step_s: float = 0.1):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True)
        self.supervisor = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, str(self.run_dir)], start_new_session=True
        )
        synthetic.write_run(
            self.run_dir,
            state="running",
            steps=50,
            max_steps=100_000,
            supervisor_pid=self.supervisor.pid,
        )
        self.status = json.loads((self.run_dir / "status.json").read_text())
        # A SIGINT before the handler is in would kill it without a trace.
        wait_for((self.run_dir / "supervisor-ready").exists, 30, "the stand-in supervisor")
        self.step = 50
        self.step_s = step_s
        self.state = "running"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        out = EventWriter(self.run_dir / "events.jsonl")
        control = JsonlTail(self.run_dir / "control.jsonl")
        next_step = time.monotonic()
        try:
            while not self._stop.wait(0.02):
                for cmd in control.read():
                    self._answer(out, cmd)
                if self.state == "running" and time.monotonic() >= next_step:
                    self.step += 10
                    out.emit("step", step=self.step, loss=0.5, lr=1e-3, samples_per_s=1000.0,
                             step_time_s=0.01, memory=[])  # fmt: skip
                    next_step = time.monotonic() + self.step_s
        finally:
            out.close()

    def _answer(self, out: EventWriter, cmd: dict) -> None:
        cid, name = cmd.get("id"), cmd.get("cmd")
        out.emit("control", id=cid, cmd=name, state="received", step=self.step)
        if name == "checkpoint":
            out.emit("checkpoint", step=self.step, path=str(self.run_dir / "checkpoints" / "x"),
                     seconds=0.01, bytes=1000, reason="request")  # fmt: skip
        elif name == "pause" and self.state == "running":
            self.state = "paused"
            out.emit("status", state="paused", reason="requested")
        elif name == "resume" and self.state == "paused":
            self.state = "running"
            out.emit("status", state="running", reason="resumed")
        elif name == "profile":  # the engine's ack once every rank wrote its trace
            first = self.step + 2  # after the warmup step
            out.emit("control", id=cid, cmd=name, state="done", step=self.step + 1 + cmd["steps"],
                     path=str(self.run_dir / "profiles" / f"step-{first:08d}"),
                     first_step=first, last_step=first + cmd["steps"] - 1, steps=cmd["steps"],
                     ranks=2, ended_by="complete")  # fmt: skip
            return
        elif name == "stop":
            out.emit("control", id=cid, cmd=name, state="done", step=self.step)
            out.emit("status", state="stopping", reason="stop")
            out.emit("checkpoint", step=self.step, path=str(self.run_dir / "checkpoints" / "y"),
                     seconds=0.01, bytes=1000, reason="stop")  # fmt: skip
            out.emit("status", state="stopped", reason="stop")
            self.state = "stopped"
            self.status.update(state="stopped", ended=time.time(), exit_code=0,
                               checkpointed_on_stop=True)  # fmt: skip
            synthetic.write_status(self.run_dir, self.status)
            return
        out.emit("control", id=cid, cmd=name, state="done", step=self.step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.supervisor.poll() is None:
            self.supervisor.kill()
        self.supervisor.wait(5)


@pytest.fixture(name="fake_live")
def fake_live_fixture(tmp_path):
    run = FakeRun(tmp_path / "runs" / "live-20260101-000000")
    yield run
    run.close()


def kill_runs(runs_dir: Path) -> None:
    """End, by pid, every process of every run under ``runs_dir`` (status.json's pids)."""
    Procs(runs_dir).cleanup()


# -- snapshots --------------------------------------------------------------------------------


def _normalise(svg: str) -> str:
    return re.sub(r"\bterminal-\d+-", "terminal-", svg)


def assert_svg(app, name: str) -> None:
    """Compare the screen with tests/tui/snapshots/NAME.svg (recorded with one textual)."""
    if os.environ.get("GPU_CONSOLE_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.mkdir(exist_ok=True)
        (SNAPSHOTS / f"{name}.svg").write_text(_normalise(app.export_screenshot(title=name)))
        (SNAPSHOTS / "TEXTUAL_VERSION").write_text(textual.__version__ + "\n")
        return
    recorded = (SNAPSHOTS / "TEXTUAL_VERSION").read_text().strip()
    # A skip here once hid every snapshot for as long as textual was unpinned: the dev extra
    # pins the version the snapshots were recorded with, and a mismatch is a failure to act on.
    assert recorded == textual.__version__, (
        f"snapshots were recorded with textual {recorded}, this is {textual.__version__}: "
        "install the dev extra's pin, or re-record (GPU_CONSOLE_UPDATE_SNAPSHOTS=1) and move "
        "the pin in pyproject.toml with it"
    )
    expected = (SNAPSHOTS / f"{name}.svg").read_text()
    actual = _normalise(app.export_screenshot(title=name))
    if actual != expected:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-console-snapshot-{name}.svg"
        out.write_text(actual)
        # CI keeps only the log: say which words changed, not just that something did.
        words = difflib.unified_diff(_svg_text(expected), _svg_text(actual), "recorded", "now",
                                     n=0, lineterm="")  # fmt: skip
        raise AssertionError(
            f"{name}: the screen differs from tests/tui/snapshots/{name}.svg; the new one is "
            f"{out} (if the change is meant: GPU_CONSOLE_UPDATE_SNAPSHOTS=1 pytest -k snapshot)\n"
            + "\n".join(list(words)[:40])
        )


def _svg_text(svg: str) -> list[str]:
    """The text runs an SVG screenshot draws, one per line, blank runs left out."""
    runs = (html.unescape(m).replace("\xa0", " ") for m in re.findall(r">([^<>]*)</text>", svg))
    return [r for r in runs if r.strip()]


# -- telemetry made for pictures and snapshots ---------------------------------------------


def picture_telemetry(run_dir: Path, fake, samples: int = 40, t0: float = synthetic.T0) -> None:
    """Write ``telemetry.jsonl`` for a 2-GPU run, each sample taken through the fake NVML
    (``fake`` is installed behind gpu_console.telemetry.nvml by the caller). The two ranks'
    processes are made up: pids 4101 and 4102 hold memory on GPU 0 and 1."""
    from gpu_console.telemetry import nvml
    from gpu_console.telemetry.ranks import rank_gpus

    gib = 2**30
    pids = (4101, 4102)
    lines = []
    for i in range(samples):
        for g, gpu in enumerate(fake.gpus[:2]):
            gpu.util_gpu = min(100, 78 + (i * 7 + g * 13) % 21)
            gpu.memory_used = int((38.0 + g * 1.5 + (i % 5) * 0.1) * gib)
            gpu.temperature = 61 + (i // 4 + g) % 9
            gpu.power_mw = 280_000 + ((i * 37 + g * 11) % 90) * 1000
            gpu.energy_mj = 9_000_000 + i * 300_000  # 300 J a sample (one a second)
            gpu.processes = [(pids[g], int((36.2 + g * 1.5) * gib))]
        sample = {
            "v": 1,
            "t": t0 + i,
            "kind": "sample",
            "nvml": {"available": True, "reason": ""},
            "gpus": [s.to_json() for s in nvml.sample_gpus()],
            "host": {
                "processes": [
                    {"pid": pid, "ppid": 4100, "role": "worker", "name": "python", "rank": r,
                     "local_rank": r, "cpu_percent": 99.0 + r, "rss": (3 + r) * gib,
                     "cuda_visible_devices": "0,1", "cuda_device_order": "PCI_BUS_ID"}
                    for r, pid in enumerate(pids)
                ]
            },
        }  # fmt: skip
        sample["ranks"] = rank_gpus(sample)
        lines.append(json.dumps(sample))
    (Path(run_dir) / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
