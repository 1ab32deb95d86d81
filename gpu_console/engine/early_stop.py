"""Early stopping (``train.early_stop_metric``): the run ends ``finished`` once its eval metric
has not improved by more than ``early_stop_min_delta`` for ``early_stop_patience`` evals in a
row.

After each eval every rank holds the same metrics (all-reduced), and rank 0's verdict is
broadcast besides (a task's ``on_eval_end`` figures are each rank's own): every rank stops
at the same step. The first eval sets the best; a later one improves on it only by more
than ``min_delta`` (lower for ``min``, higher for ``max``), and only an improvement moves the
best (a run of small gains adds up to one). A non-finite value never improves.

The count lives in the train state (``TrainState.early_stop``), saved in every checkpoint's
state (and its meta.json, for the console's launch checks): a resumed run goes on counting
where its checkpoint was, and stops at the step an uninterrupted run stops at. A resume
with another metric or direction starts a new count; turned off, the run trains on to
``max_steps``; a larger patience lets a run that stopped early train on (launch.py refuses
to resume one that stopped with the same settings: it would stop again at its next eval).

Torch-free but for the broadcast.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .refusal import Refused

if TYPE_CHECKING:
    from ..profile import TrainConfig
    from .distributed import Dist
    from .train_state import TrainState

KEY = "train.early_stop_metric"


class EarlyStop:
    """The judge of ``train.early_stop_*``; its record is the train state's ``early_stop``:
    ``{metric, mode, best, best_step, stale, stopped}`` (None: off, or no eval yet)."""

    def __init__(self, train: TrainConfig, d: Dist, state: TrainState) -> None:
        self.metric = train.early_stop_metric  # "eval.loss"; "" = off
        self.mode = train.early_stop_direction()
        self.patience = train.early_stop_patience
        self.min_delta = train.early_stop_min_delta
        self.d, self.state = d, state
        if not self.on or not same_judge(state.early_stop, self.metric, self.mode):
            state.early_stop = None  # off, or another judge: a new count
        elif state.early_stop is not None:
            state.early_stop["stopped"] = self.due(state.early_stop)

    @property
    def on(self) -> bool:
        return bool(self.metric)

    @property
    def stopping(self) -> bool:
        """The newest eval ended the run (every rank the same: :meth:`observe` agreed)."""
        rec = self.state.early_stop
        return rec is not None and bool(rec.get("stopped"))

    def due(self, rec: dict[str, Any]) -> bool:
        return int(rec["stale"]) >= self.patience

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, Any] | None:
        """Collective: this eval judged; the ``early_stop`` event's fields (None: off).

        An eval without the metric refuses the run (every rank the same verdict): a
        misspelt name would otherwise train to the end without ever stopping."""
        if not self.on:
            return None
        name = self.metric.split(".", 1)[1]
        if name not in metrics:
            known = ", ".join(f"eval.{k}" for k in sorted(metrics)) or "none"
            raise Refused(
                KEY,
                f"the eval at step {step} has no such metric (it reported {known}) "
                f"(got {self.metric!r})",
            )
        value = float(metrics[name])
        rec = self.state.early_stop
        if rec is None:
            rec = {"metric": self.metric, "mode": self.mode, "best": None, "best_step": None,
                   "stale": 0, "stopped": False}  # fmt: skip
        else:
            rec = dict(rec)
        if math.isfinite(value) and (rec["best"] is None or self._improves(value, rec["best"])):
            rec.update(best=value, best_step=step, stale=0)
        else:
            rec["stale"] = int(rec["stale"]) + 1
        rec["stopped"] = self.due(rec)
        self.state.early_stop = rec = self._agreed(rec)
        return {"step": step, "metric": self.metric, "value": value if math.isfinite(value)
                else None, "best": rec["best"], "best_step": rec["best_step"],
                "evals_since_best": rec["stale"], "patience": self.patience,
                "min_delta": self.min_delta, "mode": self.mode,
                "stop": rec["stopped"]}  # fmt: skip

    def reason(self) -> str:
        """The finished status's reason: what stopped the run, and its best."""
        rec = self.state.early_stop or {}
        return reason_text(self.metric, self.min_delta, int(rec.get("stale") or 0),
                           rec.get("best"), rec.get("best_step"))  # fmt: skip

    def _improves(self, value: float, best: float) -> bool:
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def _agreed(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's record on every rank (a small broadcast, once per eval)."""
        if self.d.world_size == 1:
            return rec
        import torch.distributed as dist

        box: list[Any] = [rec]
        dist.broadcast_object_list(box, src=0)
        return dict(box[0])


def reason_text(
    metric: str, min_delta: float, stale: int, best: float | None, best_step: int | None
) -> str:
    """``early stopping: eval.loss did not improve by 0.001 for 3 evals (best 0.512 at step
    400)``."""
    by = f" by more than {min_delta:g}" if min_delta else ""
    evals = "eval" if stale == 1 else "evals"
    where = f" (best {best:.6g} at step {best_step})" if best is not None else " (no finite value)"
    return f"early stopping: {metric} did not improve{by} for {stale} {evals}{where}"


def same_judge(rec: Any, metric: str, mode: str) -> bool:
    """Whether a saved record counts for this metric and direction."""
    return isinstance(rec, dict) and rec.get("metric") == metric and rec.get("mode") == mode
