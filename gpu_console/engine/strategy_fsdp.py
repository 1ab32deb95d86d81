"""``distributed.strategy = "fsdp"``: FSDP2 shards the model (the mechanics: fsdp.py).

What differs from DDP, all here: FSDP's own mixed precision in place of autocast, the
sharded GradScaler, clipping over shards, no communication hook (a log step's table takes a
collective of its own), and checkpoints written and loaded as shards by every rank
(sharded_checkpoint.py), loaded after sharding.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from . import fsdp, sharded_checkpoint
from .strategy import SaveJob, Strategy


class FsdpStrategy(Strategy):
    name = "fsdp"
    # Found by the parity matrix: LBFGS's state does not survive FSDP's checkpoint (a
    # KeyError in its state_dict, one rank too), and its decisions would be each shard's.
    closure_refusal = (
        "distributed.strategy",
        "a closure optimizer (LBFGS) needs every parameter's gradient for its decisions (its "
        "norms, directions and line search), and fsdp shards them over the ranks: use ddp "
        '(got "fsdp")',
    )

    def __init__(self, cfg, d) -> None:
        self.cfg, self.d = cfg, d

    def make_scaler(self, precision: str, device_type: str, init_scale: float) -> Any:
        return fsdp.make_scaler(precision, device_type, init_scale)

    def wrap(self, model, task, precision: str, optimizers, warn) -> None:
        self.wrapped = fsdp.shard(model, task, self.cfg, precision, optimizers, warn)

    def load_after_wrap(self, point: Path, model, optimizers, scalers, d) -> Any:
        return sharded_checkpoint.resume(point, model, optimizers, scalers, d.rank, d.world_size)

    def autocast(self, autocast) -> Any:
        return contextlib.nullcontext()  # FSDP's mixed precision casts instead (fsdp.py)

    @property
    def compute_model(self) -> Any:
        return self.wrapped.module

    def clip(self, optimizers, max_norm: float) -> tuple[Any, dict[str, Any]]:
        return fsdp.clip(optimizers, max_norm)  # each optimizer's on its own, over shards

    # -- a task's own train_step: gradients arrive reduced, as shards ----------------------
    def task_backward(self, loss, params: list, others: list) -> None:
        """Gradients reach the shards through FSDP's reduce-scatter after the gathered
        parameters' backward, which ``backward(inputs=shards)`` would never run. So a whole
        backward, and the other optimizers' gradients are put back as they were (a task's
        own step reduces every micro-batch, so none wait unreduced)."""
        kept = [q.grad for q in others]
        for q in others:
            q.grad = None
        loss.backward()
        for q, g in zip(others, kept, strict=True):
            q.grad = g

    def average_grads(self, params: list) -> None:
        """Reduce-scattered by FSDP in the backward already."""

    def clip_grads(self, params: list, max_norm: float) -> Any:
        return fsdp.total_norm(params, max_norm)

    def gradient_reduce(self, d, cfg, run_dir: Path) -> tuple[Any, str]:
        return None, "distributed.strategy = fsdp: gradients are reduce-scattered by FSDP"

    def save(self, job: SaveJob) -> dict[str, Any] | None:
        # Every rank writes its shards through DCP, synchronously.
        outcome = sharded_checkpoint.save(
            job.run_dir, job.step, job.reason, job.model, job.optimizers, job.state,
            job.rank_state, job.keep_last, job.is_main, job.group, job.best,
        )  # fmt: skip
        return {**outcome, "step": job.step, "reason": job.reason}

    def start_fields(self) -> dict[str, Any]:
        return {"ddp": None, "fsdp": self.wrapped.settings()}
