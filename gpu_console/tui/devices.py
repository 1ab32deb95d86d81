"""The device panel's data: NVML and per-rank host samples for one run (no Textual, no torch).

Samples come from the run's ``telemetry.jsonl``, which the run's supervisor records for its
whole life: a console only reads it (short histories, per-device cards, and the per-GPU
figures of :class:`~gpu_console.telemetry.fold.TelemetryFold`). Only for a live run that nobody
records (a run from before the supervisor recorded) does it sample for itself, in memory,
with the telemetry :class:`~gpu_console.telemetry.sampler.Sampler`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..events import JsonlTail
from ..telemetry.fold import TelemetryFold
from . import reader

# A newest sample older than this (or than twice the interval it stands for): nobody records.
FRESH_SAMPLE_S = 5.0


@dataclass(frozen=True)
class DeviceCard:
    """One GPU of the run (``gpu`` set), or one CPU rank (``gpu`` None)."""

    title: str
    gpu: dict[str, Any] | None
    ranks: list[dict[str, Any]]  # rank, pid, cpu_percent, rss, allocated, reserved, peak, nvml_used
    history: dict[str, list[float]]


@dataclass(frozen=True)
class DeviceView:
    source: str  # "live", "file" (telemetry.jsonl), or "none"
    nvml_available: bool
    nvml_reason: str
    cards: list[DeviceCard]
    sample_t: float | None = None
    note: str = ""
    gpus: tuple[dict[str, Any], ...] = ()  # per GPU over the run: TelemetryFold.gpus()


class DeviceFeed:
    """Device samples for the run screen, from the run's ``telemetry.jsonl`` (launched here,
    attached to, or ended); an in-memory Sampler only while a live run has no recorder."""

    def __init__(
        self,
        run_dir: Path,
        *,
        interval_s: float = 1.0,
        history: int = 60,
        enabled: bool = True,
    ):
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.enabled = enabled
        self.sampler = None
        self.source = "none"
        self.latest: dict[str, Any] | None = None
        self.hist: dict[str, deque] = {}
        self.history = history
        self._seen = 0
        self._file_offset: int | None = None
        self._file_checked = False
        self._file_t: float | None = None  # the newest sample read from the file
        self._file_every_s = 0.0
        self._stale_since: float | None = None
        self.figures = TelemetryFold(run_dir)

    def update(self, live: bool, last_step: dict[str, Any]) -> bool:
        if not self.enabled:
            return False
        if not live and not self._file_checked:
            self.figures.skip_to_summary()  # an ended run: its figures without the samples
        got = self.figures.poll()
        got |= self._read_file(initial=not self._file_checked)
        self._file_checked = True
        if not live or self._recorded():
            self.close()
            self._stale_since = None
            return got
        # Live, and nothing fresh in the file: give the supervisor time for its first sample.
        now = time.monotonic()
        self._stale_since = self._stale_since or now
        if now - self._stale_since >= FRESH_SAMPLE_S:
            return self._from_sampler() or got
        return got

    def _recorded(self) -> bool:
        """The run's supervisor is recording: its newest sample is as fresh as it promised."""
        if self._file_t is None:
            return False
        limit = max(FRESH_SAMPLE_S, 2 * self._file_every_s + 1.0)
        return time.time() - self._file_t < limit

    def _from_sampler(self) -> bool:
        if self.sampler is None:
            from ..telemetry.sampler import Sampler

            self.sampler = Sampler(self.run_dir, interval_s=self.interval_s).start()
            self.source = "live"
        n = self.sampler.samples
        if n == self._seen or self.sampler.latest is None:
            return False
        self._seen = n
        self._fold(self.sampler.latest)
        return True

    def _read_file(self, initial: bool) -> bool:
        path = self.run_dir / "telemetry.jsonl"
        if initial:
            samples, self._file_offset = reader.tail_jsonl(path, 512 * 2**10)
        else:
            tail = JsonlTail(path, self._file_offset or 0)
            samples = tail.read()
            self._file_offset = tail.offset
        samples = [s for s in samples if s.get("kind") == "sample"]
        for s in samples[-self.history :]:
            self._fold(s)
        if samples:
            self.source = "live" if self.sampler is not None else "file"
            self._file_t = samples[-1].get("t")
            self._file_every_s = float(samples[-1].get("every_s") or 0.0)
        return bool(samples)

    def _fold(self, sample: dict[str, Any]) -> None:
        self.latest = sample
        points: dict[str, Any] = {}
        for g in sample.get("gpus") or ():
            i = g.get("index")
            for key in ("util_gpu", "memory_used", "temperature_c", "power_w"):
                points[f"gpu{i}.{key}"] = g.get(key)
        for p in (sample.get("host") or {}).get("processes") or ():
            if p.get("role") == "worker" and p.get("rank") is not None:
                points[f"rank{p['rank']}.cpu_percent"] = p.get("cpu_percent")
                points[f"rank{p['rank']}.rss"] = p.get("rss")
        for name, value in points.items():
            series = self.hist.get(name)
            if series is None:
                series = self.hist[name] = deque(maxlen=self.history)
            series.append(value)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop(timeout=2.0)
            self.sampler = None
            self.source = "file" if self._file_t is not None else "none"

    def view(
        self, device_type: str | None, last_step: dict[str, Any], meta: dict[str, Any]
    ) -> DeviceView:
        sample = self.latest or {}
        nv = sample.get("nvml") or {}
        allocator = {m.get("rank"): m for m in last_step.get("memory") or ()}
        procs = {
            p["rank"]: p
            for p in (sample.get("host") or {}).get("processes") or ()
            if p.get("role") == "worker" and p.get("rank") is not None
        }
        rank_rows = {
            r.get("rank"): r for r in sample.get("ranks") or () if r.get("rank") is not None
        }
        ranks = sorted(set(allocator) | set(procs) | set(rank_rows), key=lambda r: (r is None, r))

        def rank_info(r: int) -> dict[str, Any]:
            mem, proc, row = allocator.get(r, {}), procs.get(r, {}), rank_rows.get(r, {})
            return {
                "rank": r,
                "pid": proc.get("pid") or row.get("pid"),
                "gpu": row.get("gpu"),
                "cpu_percent": proc.get("cpu_percent"),
                "rss": proc.get("rss"),
                "nvml_used": row.get("nvml_used"),
                "allocated": mem.get("allocated"),
                "reserved": mem.get("reserved"),
                "peak": mem.get("peak"),
            }

        infos = [rank_info(r) for r in ranks]
        gpus = {g.get("index"): g for g in sample.get("gpus") or ()}
        cards: list[DeviceCard] = []
        on_gpu = device_type == "cuda" or (
            device_type is None and (meta.get("placement") or {}).get("device_type") == "cuda"
        )
        if on_gpu and gpus:
            run_gpus = sorted({i["gpu"] for i in infos if i["gpu"] is not None})
            if not run_gpus:
                placed = meta.get("placement") or {}
                visible = placed.get("cuda_visible_devices") or ""
                run_gpus = [i for i in placed.get("gpus") or () if isinstance(i, int)] or [
                    int(x) for x in visible.split(",") if x.strip().isdigit()
                ]
            for idx in run_gpus or sorted(gpus):
                g = gpus.get(idx)
                if g is None:
                    continue
                hist = {
                    k: _values(self.hist.get(f"gpu{idx}.{k}"))
                    for k in ("util_gpu", "memory_used", "temperature_c", "power_w")
                }
                on = [i for i in infos if i["gpu"] == idx]
                cards.append(DeviceCard(f"GPU {idx}", g, on, hist))
        else:
            for info in infos:
                r = info["rank"]
                hist = {k: _values(self.hist.get(f"rank{r}.{k}")) for k in ("cpu_percent", "rss")}
                cards.append(DeviceCard(f"rank {r}", None, [info], hist))
        note = ""
        if self.source == "none" and self.enabled:
            note = "no device samples recorded for this run"
        return DeviceView(
            source=self.source,
            nvml_available=bool(nv.get("available")),
            nvml_reason=str(nv.get("reason") or ""),
            cards=cards,
            sample_t=sample.get("t"),
            note=note,
            gpus=tuple(self.figures.gpus()),
        )


def _values(series: deque | None) -> list[float]:
    return [v for v in series or () if isinstance(v, (int, float))]
