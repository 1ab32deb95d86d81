"""The device panel's data: NVML and per-rank host samples for one run (no Textual, no torch).

Samples come from the telemetry :class:`~gpu_console.telemetry.sampler.Sampler` (the only
path to NVML) or from the run's ``telemetry.jsonl``; this module only folds them into
short histories and per-device cards.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..events import JsonlTail
from . import reader

FRESH_SAMPLE_S = 5.0  # a telemetry.jsonl sample younger than this: another console samples


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


class DeviceFeed:
    """Device samples for the run screen: the console's own Sampler while the run is live
    (writing ``telemetry.jsonl`` only when this console owns the run), or the samples that
    another console records in that file, or, once the run has ended, the file's last ones."""

    def __init__(
        self,
        run_dir: Path,
        *,
        owner: bool,
        interval_s: float = 1.0,
        history: int = 60,
        enabled: bool = True,
    ):
        self.run_dir = run_dir
        self.owner = owner
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

    def update(self, live: bool, last_step: dict[str, Any]) -> bool:
        if not self.enabled:
            return False
        if not live:
            self.close()
            if not self._file_checked and self.latest is None:
                self._file_checked = True
                return self._read_file(initial=True)
            return False
        if self.owner or self.sampler is not None:
            return self._from_sampler(owner=self.owner)
        # A viewer reads what the owning console records; if nobody records, it samples.
        got = self._read_file(initial=not self._file_checked)
        self._file_checked = True
        if self.latest and time.time() - (self.latest.get("t") or 0) < FRESH_SAMPLE_S:
            return got
        return self._from_sampler(owner=False)

    def _from_sampler(self, owner: bool) -> bool:
        if self.sampler is None:
            from ..telemetry.sampler import Sampler

            self.sampler = Sampler(self.run_dir, interval_s=self.interval_s, owner=owner).start()
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
            self.source = "file"
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
                visible = (meta.get("placement") or {}).get("cuda_visible_devices") or ""
                run_gpus = [int(x) for x in visible.split(",") if x.strip().isdigit()]
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
            note = "no device samples (a console records them while it is attached)"
        return DeviceView(
            source=self.source,
            nvml_available=bool(nv.get("available")),
            nvml_reason=str(nv.get("reason") or ""),
            cards=cards,
            sample_t=sample.get("t"),
            note=note,
        )


def _values(series: deque | None) -> list[float]:
    return [v for v in series or () if isinstance(v, (int, float))]
