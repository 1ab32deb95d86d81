"""The numbers a report draws, made from a run's events and telemetry: no plotting here, so a
test reads them as they are (matplotlib and torch are not imported).

- the train loss as logged: each step event's ``loss_avg`` (the mean over its log interval)
  where it has one, else the logged batch's ``loss``;
- its smoothing, TensorBoard's: an exponential moving average, debiased so the first points
  are not pulled towards 0 (:func:`ema`, weight :data:`SMOOTHING`);
- whether a curve wants a log scale (:func:`wants_log`: more than a decade, all positive);
- telemetry over time, broken (NaN) wherever the recorder did not run (between sessions, a
  supervisor down), the machine's CPU without each session's first reading (psutil's first
  ``cpu_percent`` has no interval behind it: 0 %), and the run's own processes' CPU and
  memory beside the machine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SMOOTHING = 0.6  # TensorBoard's default: light, since loss_avg is already an interval mean
GIB = 1024**3
NAN = float("nan")
GAP_EVERY = 3.0  # a sample later than this many sampling intervals: the recorder was down
_NUM = (int, float)


def num(v: Any) -> float | None:
    return float(v) if type(v) in _NUM else None


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: ``last = last·w + (1 − w)·v``, divided by ``1 − wⁿ`` (n the
    finite points so far), so it starts at the first value rather than at 0. A non-finite
    value is drawn as a gap and leaves the average as it was."""
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(NAN)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n))
    return out


def wants_log(*curves: list[float]) -> bool:
    """A log y axis: every finite value positive and the largest over ten times the smallest
    (a first loss of 25 then leaves the rest of the curve readable)."""
    finite = [v for c in curves for v in c if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) > 10 * min(finite)


def fraction(*curves: list[float]) -> bool:
    """Every finite value within [0, 1]: an accuracy, a share."""
    finite = [v for c in curves for v in c if math.isfinite(v)]
    return bool(finite) and min(finite) >= 0 and max(finite) <= 1


def train_loss(steps: list[dict[str, Any]]) -> tuple[list[int], list[float], bool]:
    """(steps, values, whether they are interval means): ``loss_avg`` where the events carry
    it, else each logged batch's ``loss``."""
    means = any(num(s.get("loss_avg")) is not None for s in steps)
    key = "loss_avg" if means else "loss"
    xs, ys = [], []
    for s in steps:
        v = num(s.get(key))
        if v is None and means:  # an event of an older engine among newer ones
            v = num(s.get("loss"))
        if v is not None:
            xs.append(s["step"])
            ys.append(v)
    return xs, ys, means


def metric_groups(steps: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The task's train metrics by plot: ``expert_load/0`` … ``expert_load/7`` share one
    (``expert_load``), every other metric has its own. In the order they first appear."""
    groups: dict[str, list[str]] = {}
    for s in steps:
        metrics = s.get("metrics")
        if not isinstance(metrics, dict):
            continue
        for name, v in metrics.items():
            if type(v) not in _NUM:
                continue
            group = name.split("/", 1)[0] if "/" in name else name
            names = groups.setdefault(group, [])
            if name not in names:
                names.append(name)
    return groups


def metric_series(steps: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in steps:
        v = num((s.get("metrics") or {}).get(name))
        if v is not None:
            xs.append(s["step"])
            ys.append(v)
    return xs, ys


@dataclass
class Telemetry:
    """A run's telemetry as series over time (seconds since its first sample), with a NaN
    point wherever the recorder was not running (the line breaks there)."""

    t0: float | None = None
    gpus: dict[int, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    host: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    cores: int | None = None
    own_processes: bool = False  # the samples name the run's processes (their CPU and RSS)
    _last_t: float | None = None
    _every: float = 1.0
    _new_session = True  # the next sample is a recorder's first

    def end_session(self) -> None:
        """A recorder's ``summary`` line: its session ended; the next sample starts a line."""
        self._new_session = True

    def add(self, s: dict[str, Any]) -> None:
        t = num(s.get("t"))
        if t is None:
            return
        self.t0 = t if self.t0 is None else self.t0
        every = num(s.get("every_s")) or self._every
        if self._last_t is not None and t - self._last_t > GAP_EVERY * max(every, self._every):
            self._new_session = True  # the recorder was down: no line across the gap
        first = self._new_session
        if first and self._last_t is not None:
            self._break()
        self._new_session, self._last_t, self._every = False, t, every
        x = t - self.t0
        for g in s.get("gpus") or []:
            if not isinstance(g, dict) or g.get("lost") or type(g.get("index")) is not int:
                continue
            series = self.gpus.setdefault(g["index"], {})
            for key, scale in GPU_SERIES:
                if (v := num(g.get(key))) is not None:
                    series.setdefault(key, []).append((x, v * scale))
        host = s.get("host")
        if isinstance(host, dict):
            self._host(host, x, first)

    def _host(self, host: dict[str, Any], x: float, first: bool) -> None:
        cores = num(host.get("cores"))
        if cores:
            self.cores = int(cores)
        if (v := num(host.get("cpu_percent"))) is not None and not first:
            self.host.setdefault("cpu_percent", []).append((x, v))
        if (v := num(host.get("ram_used"))) is not None:
            self.host.setdefault("ram_used", []).append((x, v / GIB))
        procs = [p for p in host.get("processes") or [] if isinstance(p, dict)]
        if not procs:
            return
        self.own_processes = True
        rss = [v for p in procs if (v := num(p.get("rss"))) is not None]
        if rss:
            self.host.setdefault("run_rss", []).append((x, sum(rss) / GIB))
        # A process's CPU % is of one core; the run's share of the machine is their sum over
        # the cores. A process's first reading is None (no interval): the sum waits for all.
        cpu = [num(p.get("cpu_percent")) for p in procs]
        if self.cores and cpu and all(v is not None for v in cpu):
            self.host.setdefault("run_cpu", []).append((x, sum(cpu) / self.cores))  # type: ignore[arg-type]

    def _break(self) -> None:
        for series in [*self.gpus.values(), self.host]:
            for points in series.values():
                if points and not math.isnan(points[-1][1]):
                    points.append((points[-1][0], NAN))

    @property
    def span(self) -> float:
        return max(
            (p[0] for s in [*self.gpus.values(), self.host] for ps in s.values() for p in ps),
            default=0.0,
        )


# (telemetry field, scale) of a GPU
GPU_SERIES = (("memory_used", 1 / GIB), ("util_gpu", 1), ("temperature_c", 1), ("power_w", 1))
GPU_AXES = {  # title, y label with its unit
    "memory_used": ("memory used", "GiB"),
    "util_gpu": ("utilisation", "%"),
    "temperature_c": ("temperature", "°C"),
    "power_w": ("power", "W"),
}
