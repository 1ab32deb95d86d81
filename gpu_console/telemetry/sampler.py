"""One sample of the GPUs and the host (:func:`take_sample`), and the console's in-memory
sampler: samples at a steady rate, kept in ring buffers, never written anywhere.

A console samples for itself only where no run records anything (the launch screen, a run
from before the supervisor recorded): a run's history is ``telemetry.jsonl``, written by
its supervisor (:mod:`.recorder`). Sampling has a thread of its own: a slow driver call or a
/proc walk never delays a frame.

A ``telemetry.jsonl`` line: ``{"v": 1, "t", "kind": "sample", "nvml": {"available",
"reason"}, "gpus": [...], "host": {...}, "ranks": [...], "cost_s", "every_s"}``; the last
line of an ended run is ``{"kind": "summary", "gpus": [...]}`` (see :mod:`.recorder`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..events import JsonlTail
from . import nvml
from .host import HostSampler, RunPids, read_run_pids
from .ranks import rank_gpus

VERSION = 1
FILE = "telemetry.jsonl"
GPU_SERIES = (
    "memory_used",
    "util_gpu",
    "util_memory",
    "temperature_c",
    "power_w",
    "fan_percent",
    "sm_clock_mhz",
)
HOST_SERIES = ("cpu_percent", "ram_used", "load_1m")
PROCESS_SERIES = ("cpu_percent", "rss")


def take_sample(
    host: HostSampler, pids: RunPids | None, status: nvml.NvmlStatus | None = None
) -> dict[str, Any]:
    """One sample of every GPU, the host, and the run's processes, as plain JSON."""
    started = time.perf_counter()
    status = status or nvml.status()
    sample: dict[str, Any] = {
        "v": VERSION,
        "t": round(time.time(), 3),
        "kind": "sample",
        "nvml": {"available": status.available, "reason": status.reason},
        "gpus": [g.to_json() for g in nvml.sample_gpus()],
        "host": host.sample(pids),
    }
    sample["ranks"] = rank_gpus(sample)
    sample["cost_s"] = round(time.perf_counter() - started, 6)
    return sample


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete sample of a run's ``telemetry.jsonl`` (a torn last line is skipped)."""
    return [s for s in JsonlTail(Path(run_dir) / FILE).read() if s.get("kind") == "sample"]


class Sampler:
    """Samples every ``interval_s`` on a daemon thread; keeps ``history`` points per metric.

    ``run_dir``: the run whose processes are sampled (pids from its ``status.json``, re-read
    each tick, as workers restart).
    """

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        interval_s: float = 1.0,
        history: int = 600,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 (got {interval_s})")
        if history < 1:
            raise ValueError(f"history must be ≥ 1 (got {history})")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.interval_s = interval_s
        self.history_len = history
        self.latest: dict[str, Any] | None = None
        self.samples = 0
        self.last_error: str | None = None  # the newest failure of a tick, one line
        self._host = HostSampler()
        self._status: nvml.NvmlStatus | None = None
        self._series: dict[str, deque] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life ----------------------------------------------------------------------------
    def start(self) -> Sampler:
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="telemetry-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as e:  # a bad tick is reported, and the next one still runs
                self.last_error = f"{type(e).__name__}: {e}".splitlines()[0]
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (a suspended laptop, a stuck call): no burst
                next_at = now
            self._stop.wait(next_at - now)

    # -- sampling ------------------------------------------------------------------------
    def sample_once(self) -> dict[str, Any]:
        """Take one sample now and record it in the ring buffers."""
        if self._status is None or not self._status.available:
            self._status = nvml.status()  # the driver does not change under a running console
        pids = self._pids()
        sample = take_sample(self._host, pids, self._status)
        self._record(sample)
        self.latest = sample
        self.samples += 1
        return sample

    def _pids(self) -> RunPids | None:
        if self.run_dir is None:
            return None
        return read_run_pids(self.run_dir)

    def _record(self, sample: dict[str, Any]) -> None:
        t = sample["t"]
        points: dict[str, Any] = {}
        host = sample["host"]
        for key in HOST_SERIES:
            points[f"host.{key}"] = host.get(key)
        for gpu in sample["gpus"]:
            for key in GPU_SERIES:
                points[f"gpu{gpu['index']}.{key}"] = gpu.get(key)
        for proc in host["processes"]:
            for key in PROCESS_SERIES:
                points[f"pid{proc['pid']}.{key}"] = proc.get(key)
        for row in sample["ranks"]:
            if row["rank"] is not None:
                points[f"rank{row['rank']}.nvml_used"] = row["nvml_used"]
        with self._lock:
            for name, value in points.items():
                series = self._series.get(name)
                if series is None:
                    series = self._series[name] = deque(maxlen=self.history_len)
                series.append((t, value))
            # Processes come and go (restarts, data-loader workers): drop the departed.
            for name in [n for n in self._series if n.startswith("pid") and n not in points]:
                del self._series[name]

    def history(self, metric: str) -> list[tuple[float, Any]]:
        """(t, value) points of one metric, oldest first; value None where unavailable."""
        with self._lock:
            return list(self._series.get(metric, ()))

    def metrics(self) -> list[str]:
        with self._lock:
            return sorted(self._series)
