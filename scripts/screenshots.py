"""Pictures of the console for README and docs/: SVG from the real app, PNG through rsvg-convert.

    python scripts/screenshots.py            # writes screenshots/{launch,run}.{svg,png}

The app runs headless at 100×32 (Textual's Pilot). No machine here has a GPU: the GPUs in
the pictures are two NVML fakes put behind ``gpu_console.telemetry.nvml`` (the seam the
tests use, tests/test_telemetry_fake.py), and the run screen reads a telemetry.jsonl made
from them for the picture; its events are synthetic (tests/synthetic.py). PNGs need
``rsvg-convert`` (Debian: librsvg2-bin); without it only the SVGs are written.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "tui")]

import synthetic  # noqa: E402 - tests/synthetic.py
from test_telemetry_fake import FakeGpu, FakeNvml  # noqa: E402
from tui_support import picture_telemetry  # noqa: E402

from gpu_console.telemetry import nvml  # noqa: E402
from gpu_console.tui.app import ConsoleApp  # noqa: E402

OUT = REPO / "screenshots"
SIZE = (100, 32)
GIB = 2**30


def fake_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(0, name="NVIDIA A100-SXM4-80GB", memory_used=2 * GIB, util_gpu=0),
            FakeGpu(1, name="NVIDIA A100-SXM4-80GB", memory_used=11 * GIB, util_gpu=64,
                    temperature=58, processes=[(31337, 10 * GIB)]),
        ]
    )  # fmt: skip


def install(fake: FakeNvml) -> None:
    nvml.shutdown()
    nvml.pynvml = fake


async def shoot(app: ConsoleApp, ready, name: str) -> str:
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 30
        while not ready(app):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the screen did not get its data")
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        return app.export_screenshot(title=f"gpu-console: {name}")


def launch_picture() -> str:
    install(fake_gpus())
    os.chdir(REPO)  # ./profiles holds the local `sine` profile
    app = ConsoleApp(runs_dir=Path(tempfile.mkdtemp()) / "runs", devices_every_s=3600)
    return asyncio.run(
        shoot(app, lambda a: getattr(a.screen, "preview", None) and a.screen._devices_ready,
              "launch")
    )  # fmt: skip


def run_picture() -> str:
    fake = fake_gpus()
    fake.gpus[1].processes = []
    install(fake)
    steps, step_s = 1420, 0.19
    t0 = time.time() - steps * step_s - 3
    run = Path(tempfile.mkdtemp()) / "runs" / "transformer-20270115-093000"
    synthetic.write_run(
        run, steps=steps, max_steps=2000, log_every=20, eval_every=200, checkpoint_every=500,
        state="running", supervisor_pid=os.getpid(), device_type="cuda", precision="bf16",
        task="transformer", samples_per_s=5200.0, tokens_per_s=332_800.0, step_s=step_s, t0=t0,
    )  # fmt: skip
    picture_telemetry(run, fake, samples=60, t0=time.time() - 59)
    app = ConsoleApp(runs_dir=run.parent, run_dir=run, readonly=False)
    return asyncio.run(
        shoot(app, lambda a: getattr(a.screen, "snapshot", None)
              and a.screen.snapshot.devices.cards, "run")
    )  # fmt: skip


_TEXT = re.compile(
    r'<text class="([^"]+)" x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)" '
    r'clip-path="([^"]+)">([^<]*)</text>'
)


def one_glyph_per_cell(svg: str) -> str:
    """rsvg-convert draws braille with a proportional fallback font whose glyphs are wider
    than a cell: each braille glyph is placed at its own cell, so charts stay in their boxes
    (the SVG files keep Textual's own markup; only the PNGs are drawn from this)."""

    def split(m: re.Match) -> str:
        cls, x, y, length, clip, body = m.groups()
        chars = html.unescape(body)
        if not chars:
            return m.group(0)
        w = float(length) / len(chars)
        if not any(0x2800 <= ord(c) <= 0x28FF for c in chars):
            # rsvg-convert also drops a text's leading spaces: start it after them instead.
            lead = len(chars) - len(chars.lstrip(" \u00a0"))
            if not lead or lead == len(chars):
                return m.group(0)
            rest = chars[lead:]
            return (
                f'<text class="{cls}" x="{float(x) + lead * w:.1f}" y="{y}" '
                f'textLength="{w * len(rest):.1f}" clip-path="{clip}">'
                f"{html.escape(rest).replace(' ', '&#160;')}</text>"
            )
        return "".join(
            f'<text class="{cls}" x="{float(x) + i * w:.1f}" y="{y}" textLength="{w:.1f}" '
            f'clip-path="{clip}">{html.escape(c)}</text>'
            for i, c in enumerate(chars)
            if c not in (" ", "\u00a0")
        )

    return _TEXT.sub(split, svg)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    converter = shutil.which("rsvg-convert")
    for name, make in (("launch", launch_picture), ("run", run_picture)):
        svg = make()
        (OUT / f"{name}.svg").write_text(svg)
        if converter:
            with tempfile.NamedTemporaryFile("w", suffix=".svg", delete=False) as tmp:
                tmp.write(one_glyph_per_cell(svg))
            subprocess.run([converter, tmp.name, "-o", str(OUT / f"{name}.png")], check=True)
            os.unlink(tmp.name)
        print(f"screenshots/{name}.svg" + (f", screenshots/{name}.png" if converter else ""))
    if not converter:
        print("rsvg-convert not found (apt-get install librsvg2-bin): PNGs not written")


if __name__ == "__main__":
    main()
