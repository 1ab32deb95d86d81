"""A braille line chart: 2×4 dots per cell, axes labelled, several lines, no plotting library.

Each line is drawn point to point in dot space; a line with ``marker`` set is drawn as
``•`` marks instead (eval points), so two lines stay apart without colour (NO_COLOR).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from .text import num

_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row][col] in a cell


@dataclass(frozen=True)
class Line:
    label: str
    points: Sequence[tuple[float, float]]
    style: str
    marker: bool = False


def _finite(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if math.isfinite(y) and math.isfinite(x)]


def tick_labels(values: Sequence[float]) -> list[str]:
    """Labels for an axis's ticks that tell them apart: :func:`num`'s, unless two of them
    read alike (an lr that moves in its 4th digit: three ``1.00e-03``); then one format for
    all, with as many digits as the ticks' spacing needs."""
    labels = [num(v) for v in values]
    finite = sorted({v for v in values if math.isfinite(v)})
    if len(finite) < 2 or _apart(labels, values):
        return labels
    scale = max(abs(finite[0]), abs(finite[-1]))
    spacing = min(b - a for a, b in zip(finite, finite[1:], strict=False))
    top = math.floor(math.log10(scale))
    # Significant digits at the scale's magnitude that reach down to the spacing's.
    sig = max(1, top - math.floor(math.log10(spacing)) + 1)
    for more in range(6):  # rounding can still join two: one digit more, then another
        labels = [_fixed_format(v, top, sig + more) for v in values]
        if _apart(labels, values):
            break
    return labels


def _apart(labels: Sequence[str], values: Sequence[float]) -> bool:
    """Whether the labels, read back as numbers, are as many and in the same order as the
    values (``1.00e-03`` and ``0.001`` for two ticks differ as text, not as numbers)."""
    try:
        read = [float(label.replace(",", "")) for label in labels]
    except ValueError:
        return False
    order = sorted(range(len(values)), key=lambda i: values[i])
    return all(read[a] < read[b] for a, b in zip(order, order[1:], strict=False))


def _fixed_format(x: float, top: int, sig: int) -> str:
    """``x`` with ``sig`` significant digits counted from the ``10**top`` place."""
    if not math.isfinite(x):
        return str(x)
    if top >= 9 or top < -3:  # where num() writes an exponent
        return f"{x:.{max(0, sig - 1)}e}"
    return f"{x:,.{max(0, sig - 1 - top)}f}"


def render_chart(
    lines: Sequence[Line],
    width: int,
    height: int,
    *,
    empty: str = "waiting for data…",
    y_fmt: Callable[[Sequence[float]], list[str]] = tick_labels,
    x_fmt: Callable[[float], str] = lambda x: f"{x:,.0f}",
    x_axis: bool = True,
) -> Text:
    data = [(ln, _finite(ln.points)) for ln in lines]
    data = [(ln, pts) for ln, pts in data if pts]
    if width < 12 or height < (2 if x_axis else 1) or not data:
        return Text(empty if width >= len(empty) else "", style="dim")
    xs = [x for _, pts in data for x, _ in pts]
    ys = [y for _, pts in data for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12 * max(1.0, abs(y1)):
        y0, y1 = y0 - (abs(y0) * 0.05 or 0.5), y1 + (abs(y1) * 0.05 or 0.5)
    else:
        pad = (y1 - y0) * 0.04
        y0, y1 = (0.0 if y0 >= 0 and y0 - pad < 0 else y0 - pad), y1 + pad
    plot_h = height - 1 if x_axis else height
    rows = {plot_h - 1: y0, 0: y1}
    if plot_h >= 5:
        rows[(plot_h - 1) // 2] = (y0 + y1) / 2
    labels = dict(zip(rows, y_fmt(list(rows.values())), strict=True))
    # Wider than 9 only where the ticks need it to stay apart, never past half the width.
    lw = min(max(9, width // 2), max(len(s) for s in labels.values()))
    plot_w = width - lw - 1
    if plot_w < 4:
        return Text("")
    dots_w, dots_h = plot_w * 2, plot_h * 4
    sx = (dots_w - 1) / (x1 - x0) if x1 > x0 else 0.0
    sy = (dots_h - 1) / (y1 - y0)

    def to_dot(x: float, y: float) -> tuple[int, int]:
        dx = round((x - x0) * sx) if sx else dots_w // 2
        dy = round((y1 - y) * sy)
        return min(max(dx, 0), dots_w - 1), min(max(dy, 0), dots_h - 1)

    bits: dict[tuple[int, int], int] = {}
    owner: dict[tuple[int, int], str] = {}
    marks: dict[tuple[int, int], str] = {}
    for ln, pts in data:
        if ln.marker:
            for x, y in pts:
                dx, dy = to_dot(x, y)
                marks[(dx // 2, dy // 4)] = ln.style
            continue
        prev = None
        for x, y in pts:
            cur = to_dot(x, y)
            if prev is None:
                seg = [cur]
            else:
                n = max(abs(cur[0] - prev[0]), abs(cur[1] - prev[1]))
                seg = [
                    (
                        prev[0] + round((cur[0] - prev[0]) * i / n),
                        prev[1] + round((cur[1] - prev[1]) * i / n),
                    )
                    for i in range(1, n + 1)
                ] or [cur]
            for dx, dy in seg:
                cell = (dx // 2, dy // 4)
                bits[cell] = bits.get(cell, 0) | _BITS[dy % 4][dx % 2]
                owner[cell] = ln.style
            prev = cur
    out = Text(no_wrap=True, overflow="crop")
    for row in range(plot_h):
        label = labels.get(row)
        out.append((label or "")[:lw].rjust(lw), style="dim")
        out.append("┤" if label else "│", style="dim")
        run_style, run = None, []
        for col in range(plot_w):
            cell = (col, row)
            if cell in marks:
                ch, st = "•", marks[cell]
            elif cell in bits:
                ch, st = chr(0x2800 + bits[cell]), owner[cell]
            else:
                ch, st = " ", None
            if st != run_style and run:
                out.append("".join(run), style=run_style or "")
                run = []
            run_style = st
            run.append(ch)
        if run:
            out.append("".join(run), style=run_style or "")
        if row < plot_h - 1 or x_axis:
            out.append("\n")
    if not x_axis:
        return out
    left, right = x_fmt(x0), x_fmt(x1)
    gap = plot_w - len(left) - len(right)
    axis = left + " " * gap + right if gap >= 1 else right.rjust(plot_w)
    out.append(" " * lw + "└", style="dim")
    out.append(axis[:plot_w], style="dim")
    return out


class BrailleChart(Widget):
    """Draws :class:`Line` s; :meth:`plot` replaces them (and redraws only if they changed)."""

    def __init__(self, *, empty: str = "waiting for data…", **kwargs) -> None:
        super().__init__(**kwargs)
        self.lines: tuple[Line, ...] = ()
        self.empty = empty
        self.y_fmt: Callable[[Sequence[float]], list[str]] = tick_labels
        self._version = 0
        self._cache: tuple[object, Text] | None = None

    def titles(self, title: str, subtitle: str | None = None) -> None:
        """Set the border titles, only when they change (each set asks for a redraw)."""
        if self.border_title != title:
            self.border_title = title
        if subtitle is not None and self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def plot(self, lines: Sequence[Line], empty: str | None = None) -> None:
        lines = tuple(lines)
        if empty is not None:
            self.empty = empty
        if lines != self.lines or (empty is not None and not lines):
            self.lines = lines
            self._version += 1
            self.refresh()

    def render(self) -> Text:
        w, h = self.content_size.width, self.content_size.height
        key = (self._version, w, h, self.empty)
        if self._cache is None or self._cache[0] != key:
            # Small charts give their x-axis row to the plot (the loss chart shows the steps).
            text = render_chart(self.lines, w, h, empty=self.empty, y_fmt=self.y_fmt, x_axis=h >= 6)
            self._cache = (key, text)
        return self._cache[1]
