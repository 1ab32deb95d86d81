"""The best checkpoint (``checkpoint.keep_best``): which eval was best, and its checkpoint kept.

After each eval every rank holds the same metrics (all-reduced), so every rank decides the
same: an improvement makes the loop checkpoint that step (if no interval or end checkpoint
falls there anyway), and that checkpoint is marked best: ``checkpoints/BEST`` names it
(written atomically after LATEST, like LATEST), its meta.json says ``"best": true``, and
pruning (``keep_last``) never deletes it; the previous best goes once superseded (unless it
is among the last ``keep_last``). Every checkpoint's meta.json carries ``best_so_far`` (the
record as of its step), so a resumed run (always from LATEST) goes on judging against the
best value so far, never overwriting a better best with a worse one.

Torch-free: it only compares floats and reads JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from ..runs import best_checkpoint, read_json


class Best:
    """The best eval so far. ``record``: ``{metric, mode, value, step}`` or None."""

    def __init__(self, metric: str, mode: str, record: dict[str, Any] | None = None) -> None:
        self.metric = metric  # "eval.loss"; "" = off
        self.mode = mode  # "min" | "max"
        self.record = record if _same_judge(record, metric, mode) else None
        self.missing_said = False

    @property
    def on(self) -> bool:
        return bool(self.metric)

    def observe(self, step: int, metrics: dict[str, float], warn: Callable[[str], None]) -> bool:
        """True when this eval improved on the best (the step's checkpoint becomes the best).

        A metric the eval did not report: ``warn`` (once) names those it did; never best.
        """
        if not self.on:
            return False
        name = self.metric.split(".", 1)[1]
        value = metrics.get(name)
        if value is None:
            if self.missing_said:
                return False
            self.missing_said = True
            known = ", ".join(f"eval.{k}" for k in sorted(metrics)) or "none"
            warn(
                f"checkpoint.keep_best = {self.metric!r}: the eval at step {step} has no such "
                f"metric (it reported {known}); no best checkpoint is kept"
            )
            return False
        value = float(value)
        if not math.isfinite(value):
            return False
        better = self.record is None or _better(value, self.record["value"], self.mode)
        if better:
            self.record = {"metric": self.metric, "mode": self.mode, "value": value, "step": step}
        return better

    def for_save(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint at ``step`` records: the best so far, and whether it is this one."""
        if not self.on:
            return None
        return {"so_far": self.record, "is_best": bool(self.record and self.record["step"] == step)}


def resumed(metric: str, mode: str, checkpoint: Path | None, run_dir: Path) -> Best:
    """The best so far of a resumed run: the resumed checkpoint's record, or BEST's own (an
    older checkpoint without one), the better of the two when both judge alike."""
    best = Best(metric, mode)
    if not best.on or checkpoint is None:
        return best
    candidates = [_so_far(Path(checkpoint))]
    named = best_checkpoint(run_dir)
    if named is not None:
        candidates.append(_so_far(named))
    for rec in candidates:
        if not _same_judge(rec, metric, mode) or not isinstance(rec.get("value"), (int, float)):
            continue
        if best.record is None or _better(rec["value"], best.record["value"], mode):
            best.record = dict(rec)
    return best


def _so_far(path: Path) -> dict[str, Any] | None:
    meta = read_json(path / "meta.json")
    rec = meta.get("best_so_far") if isinstance(meta, dict) else None
    return rec if isinstance(rec, dict) else None


def _same_judge(record: dict[str, Any] | None, metric: str, mode: str) -> TypeGuard[dict[str, Any]]:
    if not isinstance(record, dict):
        return False
    return record.get("metric") == metric and record.get("mode") == mode


def _better(value: float, than: float, mode: str) -> bool:
    return value < than if mode == "min" else value > than
