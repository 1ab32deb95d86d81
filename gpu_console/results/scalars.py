"""The scalars a run's events and telemetry samples hold, by the names every mirror writes them
under (TensorBoard's tags, W&B's keys): one mapping, so the two never disagree (no torch).

Every value returned is a finite-or-not float (a NaN loss stays NaN); None and non-numbers
are left out, and so are booleans.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3
_NUM = (int, float)


def _kept(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if type(v) in _NUM}


def of_step(e: dict[str, Any]) -> dict[str, float]:
    """A step event's: ``train/…``, ``throughput/…``, ``memory/rank<i>/…``."""
    values: dict[str, Any] = {
        "train/loss": e.get("loss"),
        "train/loss_avg": e.get("loss_avg"),
        "train/grad_norm": e.get("grad_norm"),
        "train/lr": e.get("lr"),
        "train/skipped": e.get("skipped"),
        "throughput/samples_per_s": e.get("samples_per_s"),
        "throughput/tokens_per_s": e.get("tokens_per_s"),
        "throughput/mfu": e.get("mfu"),
    }
    if type(e.get("step_time_s")) in _NUM:
        values["throughput/step_time_ms"] = e["step_time_s"] * 1000
    for group, key in (("lrs", "train/lr"), ("grad_norms", "train/grad_norm")):
        if isinstance(e.get(group), dict):
            values.update((f"{key}/{k}", v) for k, v in e[group].items())
    if isinstance(e.get("metrics"), dict):
        values.update((f"train/{k}", v) for k, v in e["metrics"].items())
    for m in e.get("memory") or []:
        if isinstance(m, dict) and type(m.get("rank")) is int:
            for field in ("allocated", "peak"):
                if type(m.get(field)) in _NUM:
                    values[f"memory/rank{m['rank']}/{field}_gib"] = m[field] / GIB
    return _kept(values)


def of_eval(e: dict[str, Any]) -> dict[str, float]:
    """An eval event's: ``eval/<metric>``, a named split's ``eval/<split>/<metric>``."""
    return _kept({f"eval/{k}": v for k, v in e.items() if k not in ("v", "t", "kind", "step")})


def of_sample(s: dict[str, Any]) -> dict[str, float]:
    """A telemetry sample's: ``gpu<i>/…`` for each GPU it read, ``host/…``."""
    values: dict[str, Any] = {}
    for g in s.get("gpus") or []:
        if not isinstance(g, dict) or g.get("lost") or type(g.get("index")) is not int:
            continue
        name = f"gpu{g['index']}"
        values[f"{name}/util_percent"] = g.get("util_gpu")
        if type(g.get("memory_used")) in _NUM:
            values[f"{name}/memory_used_gib"] = g["memory_used"] / GIB
        values[f"{name}/temperature_c"] = g.get("temperature_c")
        values[f"{name}/power_w"] = g.get("power_w")
    host = s.get("host")
    if isinstance(host, dict):
        values["host/cpu_percent"] = host.get("cpu_percent")
        if type(host.get("ram_used")) in _NUM:
            values["host/ram_used_gib"] = host["ram_used"] / GIB
    return _kept(values)
