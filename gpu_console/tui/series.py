"""Chart series that stay small however long a run is (no Textual, no torch).

:class:`Series` keeps at most ``capacity`` points: when it fills up, neighbouring points are
averaged in pairs and each later point stands for twice as many raw ones. Appending stays
O(1) amortised and a chart draws the same number of points at step 100 and at step 10⁷:
long runs are downsampled, never slowed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

Point = tuple[float, float]


class Series:
    def __init__(self, capacity: int = 1024, recent: int = 2048):
        if capacity < 2:
            raise ValueError("capacity must be ≥ 2")
        self.capacity = capacity
        self.points: list[Point] = []
        self.recent: deque[Point] = deque(maxlen=recent)  # raw, for short windows
        self.stride = 1  # raw points per stored point
        self._sum = 0.0
        self._n = 0
        self.count = 0  # raw points appended

    def __len__(self) -> int:
        return len(self.points) + (1 if self._n else 0)

    @property
    def last(self) -> Point | None:
        return self.recent[-1] if self.recent else None

    def append(self, x: float, y: float | None) -> None:
        if y is None or not isinstance(y, (int, float)):
            return
        y = float(y)
        self.count += 1
        self.recent.append((x, y))
        self._sum += y
        self._n += 1
        if self._n >= self.stride:
            self.points.append((x, self._sum / self._n))
            self._sum, self._n = 0.0, 0
            if len(self.points) > self.capacity:
                self._halve()

    def extend(self, points: Iterable[Point]) -> None:
        for x, y in points:
            self.append(x, y)

    def _halve(self) -> None:
        pts = self.points
        merged = [
            (pts[i + 1][0], (pts[i][1] + pts[i + 1][1]) / 2) for i in range(0, len(pts) - 1, 2)
        ]
        if len(pts) % 2:
            merged.append(pts[-1])
        self.points = merged
        self.stride *= 2

    def view(self, last_steps: float | None = None) -> list[Point]:
        """Points to draw: the whole run, or the last ``last_steps`` steps (raw if kept)."""
        if last_steps is None:
            out = list(self.points)
            if self._n and self.recent:
                out.append((self.recent[-1][0], self._sum / self._n))
            return out
        if not self.recent:
            return []
        start = self.recent[-1][0] - last_steps
        if self.recent[0][0] <= start or len(self.recent) == self.count:
            return [p for p in self.recent if p[0] >= start]
        return [p for p in self.view() if p[0] >= start]


def finite(y: float) -> bool:
    return isinstance(y, (int, float)) and math.isfinite(y)
