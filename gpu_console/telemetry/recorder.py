"""The run's own recorder: the supervisor writes ``telemetry.jsonl`` for the whole run.

Every GPU of the run (matched by UUID: the placement's CUDA mask, and any GPU a rank holds
memory on) and each of the run's processes (CPU %, RSS) are sampled every
:data:`INTERVAL_S` on a thread of its own, so a slow driver call never delays the
supervisor's tick. One writer: an advisory lock on the file; a second recorder only folds.

Bounded size: every sample is written for the first :data:`LEVEL_LINES` lines, then every
2nd for the next :data:`LEVEL_LINES`, then every 4th, … so the file grows with the logarithm
of the run's length (a week at 1 s: 10 levels, under 10 000 lines; README has the sizes).
Each line says the interval it now stands for (``every_s``). Nothing is lost from the
figures: the recorder folds *every* sample (:class:`~gpu_console.state.TelemetryFold`) and
ends the file with a ``summary`` line, the fold of the whole run, that readers take as is.

Only the standard library is imported here: NVML, psutil and the fold are imported on the
recorder's thread, so starting it costs the supervisor nothing before torchrun starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import strict_json
from ..diskfull import append_whole

FILE = "telemetry.jsonl"
INTERVAL_S = 1.0
LEVEL_LINES = 1000
FINAL_WAIT_S = 5.0  # stop() waits this long for the last sample; a hung driver is left behind


class Thinning:
    """Which ticks are written: every ``stride``-th, the stride doubling every ``level_lines``
    lines written (``lines``: those already in the file, for a run continued in it)."""

    def __init__(self, level_lines: int = LEVEL_LINES, lines: int = 0):
        if level_lines < 1:
            raise ValueError(f"level_lines must be ≥ 1 (got {level_lines})")
        self.level_lines = level_lines
        self.lines = lines
        self._since = 0  # ticks since the last written one

    @property
    def stride(self) -> int:
        return 2 ** (self.lines // self.level_lines)

    def due(self) -> bool:
        """Called once a tick: True when this tick's sample is written."""
        self._since += 1
        if self._since < self.stride:
            return False
        self._since = 0
        self.lines += 1
        return True


def lines_after(ticks: int, level_lines: int = LEVEL_LINES) -> int:
    """Lines written after ``ticks`` ticks (the closed form of :class:`Thinning`)."""
    lines, level = 0, 0
    while ticks > 0:
        take = min(ticks, level_lines * 2**level)
        lines += take // 2**level
        ticks -= take
        level += 1
    return lines


class Recorder:
    """Samples the run every ``interval_s`` into ``RUN/telemetry.jsonl`` until :meth:`stop`.

    ``sample``: a callable returning one sample (tests); by default, NVML and psutil.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        interval_s: float = INTERVAL_S,
        level_lines: int = LEVEL_LINES,
        sample: Callable[[], dict[str, Any]] | None = None,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 (got {interval_s})")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / FILE
        self.interval_s = interval_s
        self.level_lines = level_lines
        self._take = sample
        self.thinning = Thinning(level_lines)
        self.fold = None  # state.TelemetryFold, made on the thread
        self.ticks = 0
        self.latest: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.write_error: str | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run_uuids: set[str] = set()
        self._mask: str | None = None

    # -- life ----------------------------------------------------------------------------
    def start(self) -> Recorder:
        self._open()
        self._thread = threading.Thread(target=self._loop, name="telemetry-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = FINAL_WAIT_S) -> None:
        """The last sample and the summary line are written; then the file is closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # stuck in the driver: the run's end is recorded without its summary
            self._thread = None
        self._close()

    @property
    def writing(self) -> bool:
        return self._fd is not None

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            self.write_error = f"{self.path}: cannot open ({e.strerror})"
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self.write_error = f"{self.path}: another process is recording it"
            return
        self._fd = fd
        # A supervisor killed mid-line left a torn line: start on a line of our own.
        with contextlib.suppress(OSError):
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                os.write(fd, b"\n")

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # also releases the lock
            self._fd = None

    def _loop(self) -> None:
        try:
            self._setup()
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}".splitlines()[0]
            return
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._guarded(self.tick)
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (a stuck call): no burst of samples after it
                next_at = now
            self._stop.wait(next_at - now)
        self._guarded(self.finish)

    def _guarded(self, step: Callable[[], Any]) -> None:
        try:
            step()
        except Exception as e:  # a bad tick is kept for the log; the next one still runs
            self.last_error = f"{type(e).__name__}: {e}".splitlines()[0]

    def _setup(self) -> None:
        from ..state import TelemetryFold

        # What the file holds already (a run continued in its directory): the fold and the
        # thinning go on from it, so the summary covers the whole run and the bound holds.
        self.fold = TelemetryFold(self.run_dir, nodes=False)  # this node's file: its own
        self.fold.poll()
        self.thinning = Thinning(self.level_lines, self.fold.samples)
        if self._take is None:
            self._take = self._default_sampler()

    # -- sampling ------------------------------------------------------------------------
    def tick(self) -> dict[str, Any]:
        """One sample: folded always, written when the thinning says so."""
        sample = self._take()
        self.ticks += 1
        self.fold.add(sample)
        self.latest = sample
        if self.thinning.due():
            self._write(sample)
        return sample

    def finish(self) -> None:
        """The run's last sample (whatever the stride) and the summary of the whole run."""
        sample = self._take()
        self.fold.add(sample)
        self.latest = sample
        self.thinning.lines += 1
        self._write(sample)
        self._write_line(
            {
                "v": 1,
                "t": sample.get("t", round(time.time(), 3)),
                "kind": "summary",
                "ticks": self.ticks + 1,
                "nvml": self.fold.nvml,
                "gpus": self.fold.gpus(),
            }
        )

    def _write(self, sample: dict[str, Any]) -> None:
        self._write_line({**sample, "every_s": self.interval_s * self.thinning.stride})

    def _write_line(self, obj: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = (strict_json.dumps(obj, separators=(",", ":")) + "\n").encode()
        try:
            # One write per line, O_APPEND, and none torn by a full disk: readers see whole lines.
            append_whole(self._fd, line)
            self.write_error = None
        except OSError as e:
            self.write_error = f"{self.path}: {e.strerror}"

    def _default_sampler(self) -> Callable[[], dict[str, Any]]:
        from ..runs import read_json
        from . import nvml
        from .host import HostSampler, read_run_pids
        from .sampler import take_sample

        placement = (read_json(self.run_dir / "meta.json") or {}).get("placement") or {}
        if placement.get("device_type") == "cuda":
            self._mask = placement.get("cuda_visible_devices")
        host = HostSampler()
        status: list[nvml.NvmlStatus] = []

        def take() -> dict[str, Any]:
            if not status or not status[0].available:
                status[:] = [nvml.status()]
            sample = take_sample(host, read_run_pids(self.run_dir), status[0])
            sample["gpus"] = self.run_gpus(sample)
            return sample

        return take

    def run_gpus(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """The sample's GPUs that are the run's: in its CUDA mask, or holding a rank."""
        from .ranks import visible_uuids

        gpus = sample.get("gpus") or []
        if self._mask is not None:
            mapped = visible_uuids(self._mask, "PCI_BUS_ID", gpus)
            if mapped is not None:
                self._run_uuids.update(mapped)
                self._mask = None
        self._run_uuids.update(r["uuid"] for r in sample.get("ranks") or () if r.get("uuid"))
        return [g for g in gpus if g.get("uuid") in self._run_uuids]
