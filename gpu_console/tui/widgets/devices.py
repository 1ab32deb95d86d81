"""The device panel: one card per GPU of the run (or per CPU rank), with short histories."""

from __future__ import annotations

from rich.text import Text

from ...telemetry.figures import describe, several_nodes, title
from ..devices import DeviceCard, DeviceView
from .panel import TextPanel
from .text import bar, human_bytes, spark

GIB = 2**30


def _gib(n: float | None) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{n / GIB:.1f}"


def _pct(v) -> str:
    return "  -%" if not isinstance(v, (int, float)) else f"{v:3.0f}%"


def gpu_card(card: DeviceCard, width: int, fig: dict | None = None) -> Text:
    g = card.gpu or {}
    h = card.history
    sw = max(4, min(16, (width - 60) // 2))
    t = Text(no_wrap=True, overflow="ellipsis")
    ranks = ", ".join(f"r{r['rank']}" for r in card.ranks) or "no rank"
    t.append(f"{card.title} ", style="bold")
    t.append(f"{g.get('name') or '?'}", style="bold #87afff")
    t.append(f" · {ranks}", style="dim")
    if fig:
        t.append(f"   run: {describe(fig, name=False, short=True)}", style="dim")
    if g.get("lost"):
        t.append("  LOST: the GPU stopped answering", style="bold #ff5f5f")
        return t
    t.append("\n")
    used, total = g.get("memory_used"), g.get("memory_total")
    frac = used / total if isinstance(used, int) and isinstance(total, int) and total else None
    t.append("mem  ")
    t.append(bar(frac, 12), style="#5fafff")
    t.append(f" {_gib(used)}/{_gib(total)} GiB ")
    t.append(spark(h.get("memory_used", []), sw, 0, total or None), style="#5fafff")
    t.append("  util ")
    t.append(_pct(g.get("util_gpu")), style="bold")
    t.append(" ")
    t.append(spark(h.get("util_gpu", []), sw, 0, 100), style="#5fd75f")
    t.append("\n")
    temp, power, limit = g.get("temperature_c"), g.get("power_w"), g.get("power_limit_w")
    t.append("temp ")
    t.append("  -°C" if temp is None else f"{temp:3d}°C", style="bold")
    t.append(" ")
    t.append(spark(h.get("temperature_c", []), sw, 20, 95), style="#ffaf5f")
    pw = "-" if power is None else f"{power:.0f}"
    lim = "" if limit is None else f"/{limit:.0f}"
    t.append(f"  power {pw}{lim} W ")
    t.append(spark(h.get("power_w", []), sw, 0, limit or None), style="#ffd75f")
    for r in card.ranks:
        t.append("\n")
        t.append(f"  r{r['rank']} allocator ", style="dim")
        t.append(
            f"alloc {_gib(r.get('allocated'))} · reserved {_gib(r.get('reserved'))} · "
            f"peak {_gib(r.get('peak'))} GiB"
        )
        used_r, reserved = r.get("nvml_used"), r.get("reserved")
        if isinstance(used_r, int) and isinstance(reserved, int):
            t.append(f" · outside it {_gib(used_r - reserved)} GiB", style="dim")
    return t


def cpu_card(card: DeviceCard, width: int) -> Text:
    r = card.ranks[0] if card.ranks else {}
    h = card.history
    wide = width >= 100
    sw = max(4, min(16, (width - (72 if wide else 52)) // 2))
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{card.title:<7}", style="bold")
    cpu = r.get("cpu_percent")
    t.append(" CPU ")
    t.append("   -%" if cpu is None else f"{cpu:4.0f}%", style="bold")
    t.append(" ")
    t.append(spark(h.get("cpu_percent", []), sw, 0, 100), style="#5fd75f")
    t.append("  RSS ")
    t.append(f"{human_bytes(r.get('rss')):>10}", style="bold")
    t.append(" ")
    t.append(spark(h.get("rss", []), sw), style="#5fafff")
    if wide:
        t.append(f"  alloc {human_bytes(r.get('allocated'))}")
    t.append(f"  peak {human_bytes(r.get('peak'))}", style="dim")
    return t


def devices_text(view: DeviceView, width: int) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    gpu_cards = [c for c in view.cards if c.gpu is not None]
    if not gpu_cards and view.source != "none" and not view.nvml_available:
        reason = view.nvml_reason or "NVML unavailable"
        out.append(f"no GPU: {reason}; per-rank CPU and RSS", style="dim")
    elif view.note:
        out.append(view.note, style="dim")
    figures = {f.get("uuid"): f for f in view.gpus}
    for card in view.cards:
        if out:
            out.append("\n")
        if card.gpu is not None:
            out.append_text(gpu_card(card, width, figures.pop(card.gpu.get("uuid"), None)))
        else:
            out.append_text(cpu_card(card, width))
    if not view.cards:
        out.append("\nno ranks yet", style="dim")
    marked = several_nodes(view.gpus)  # another node's GPUs: named with their node and host
    for fig in figures.values():  # GPUs of the run without a card of their own
        out.append("\n")
        out.append_text(figures_line(fig, marked))
    return out


def figures_line(fig: dict, nodes: bool = False) -> Text:
    """What one GPU did over the run so far (the run's telemetry, folded)."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{title(fig, nodes)} ", style="bold")
    t.append(f"{fig.get('name') or '?'}", style="bold #87afff")
    t.append(f"   run: {describe(fig, name=False, short=True)}", style="dim")
    return t


class DevicePanel(TextPanel):
    _view: DeviceView | None = None

    def show(self, view: DeviceView) -> None:
        self._view = view
        self.show_text(devices_text(view, self.content_size.width or 80))

    def on_resize(self) -> None:
        if self._view is not None:
            self.show_text(devices_text(self._view, self.content_size.width or 80))
