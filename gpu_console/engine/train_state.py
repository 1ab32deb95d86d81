"""The trainer's state that its parts share: where the run is, and whether it is paused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .data import Batches


@dataclass
class TrainState:
    step: int  # updates completed
    batches: Batches  # the training data, and its position (saved in checkpoints)
    evaluated_at: int | None = None  # the step of the newest eval (saved for eval_at_start)
    # train.early_stop_metric's count (early_stop.py), saved in checkpoints; None: off or no eval
    early_stop: dict[str, Any] | None = None
    paused: bool = False  # by the console's pause command, until its resume
