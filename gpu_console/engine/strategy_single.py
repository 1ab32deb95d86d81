"""One rank, ``distributed.strategy = "ddp"``: no DDP wrapper, as Lightning's single device.

DDP on one rank all-reduces every bucket with itself and scales by 1/1: a fixed cost per
step for nothing (issue 26). Here the model is trained as it is, behind the small surface the
trainer holds (``.module``, ``no_sync()``), so checkpoints, resume on more ranks and
``export`` see the same state as under DDP (the same ``module.`` keys, the bare model's
state saved). The losses are DDP's on one rank to the bit: its averaging over one rank is
the identity.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from torch import nn

from .strategy_ddp import DdpStrategy


class OneDevice(nn.Module):
    """The model as the trainer holds a wrapped one: called as it is, ``.module`` the bare
    model (registered as DDP registers it, so the state's keys are DDP's)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing to reduce, so nothing to hold back


class SingleStrategy(DdpStrategy):
    """DDP's scaler, clipping, checkpoints and resume; no wrapper, no reduction."""

    name = "single"

    def wrap(self, model, task, precision_: str, optimizers, warn) -> None:
        self.wrapped = OneDevice(model)

    @property
    def compute_model(self) -> Any:
        """The bare model (a task's ``unwrap`` of it is itself), as under fsdp."""
        return self.wrapped.module

    def gradient_reduce(self, d, cfg, run_dir: Path) -> tuple[Any, str]:
        return None, "one rank: no gradients to reduce"

    def carry_table(self, exchange) -> None:
        """No all-reduce to ride: the table is gathered on its own (one rank: no traffic)."""

    def start_fields(self) -> dict[str, Any]:
        return {"ddp": None, "fsdp": None}
