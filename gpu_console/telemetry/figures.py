"""One line per GPU of a run, from :meth:`gpu_console.telemetry.fold.TelemetryFold.gpus`: what the
headless summary, ``status`` and the run screen say the GPUs did (plain text, no imports)."""

from __future__ import annotations

from typing import Any

GIB = 2**30
SOURCES = {"counter": "NVML energy counter", "power": "integrated power"}


def describe(fig: dict[str, Any], name: bool = True, short: bool = False) -> str:
    """``NVIDIA H100 80GB HBM3: util 87 %, peak 71.2 GiB / 80 GiB, max 74 °C, 312 Wh
    (NVML energy counter)``; a reading no sample had is left out, never shown as 0.
    ``short`` (a card's title line): no memory total and no energy source."""
    parts = []
    util = fig.get("util_mean")
    if isinstance(util, (int, float)):
        parts.append(f"util {util:.0f} %")
    peak, total = fig.get("memory_peak"), fig.get("memory_total")
    if isinstance(peak, int):
        of = f" / {total / GIB:.0f} GiB" if total and not short else ""
        parts.append(f"peak {peak / GIB:.1f} GiB{of}")
    temp = fig.get("temperature_max")
    if isinstance(temp, (int, float)):
        parts.append(f"max {temp:.0f} °C")
    wh = fig.get("energy_wh")
    if isinstance(wh, (int, float)):
        digits = 0 if wh >= 100 else 1 if wh >= 1 else 3
        source = "" if short else SOURCES.get(fig.get("energy_source") or "", "")
        parts.append(f"{wh:.{digits}f} Wh" + (f" ({source})" if source else ""))
    text = ", ".join(parts) or "no readings"
    return f"{fig.get('name') or 'GPU'}: {text}" if name else text


def title(fig: dict[str, Any], nodes: bool = False) -> str:
    """``GPU 0``; with ``nodes`` (a run whose GPUs span several nodes) ``GPU 0, node 1 (host)``."""
    index = fig.get("index")
    name = f"GPU {index}" if index is not None else f"GPU {fig.get('uuid')}"
    if nodes and fig.get("node") is not None:
        host = fig.get("host")
        name += f", node {fig['node']}" + (f" ({host})" if host else "")
    return name


def several_nodes(figs: Any) -> bool:
    """Whether a run's GPUs (``TelemetryFold.gpus()``) come from more than one node."""
    return len({(g.get("node"), g.get("host")) for g in figs}) > 1
