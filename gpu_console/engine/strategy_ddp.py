"""``distributed.strategy = "ddp"``: every rank holds the whole model, DDP averages gradients.

A log step's table rides DDP's gradient all-reduce (a communication hook, exchange.py); CPU
ranks on one machine may sum through shared memory (shared_reduce.py). Checkpoints are the
whole state in plain files, written by rank 0 in the background (checkpoint_writer.py), and
loaded into the bare model before DDP wraps it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, precision
from . import distributed as distmod
from .shared_reduce import SharedReduce
from .strategy import SaveJob, Strategy


class DdpStrategy(Strategy):
    name = "ddp"

    def __init__(self, cfg, d) -> None:
        self.cfg, self.d = cfg, d

    def make_scaler(self, precision_: str, device_type: str) -> Any:
        return precision.make_scaler(precision_, device_type)

    def load_before_wrap(self, point: Path, model, optimizers, scalers, d) -> Any:
        # The optimizers keep this profile's settings over the saved ones (optim_set.py).
        return checkpoint.resume(point, model, optimizers, scalers, d.rank, d.world_size)

    def wrap(self, model, task, precision_: str, optimizers, warn) -> None:
        self.wrapped = distmod.wrap(model, self.cfg, self.d)

    def clip(self, optimizers, max_norm: float) -> tuple[Any, dict[str, Any]]:
        return optimizers.clip(max_norm)

    def gradient_reduce(self, d, cfg, run_dir: Path) -> tuple[SharedReduce | None, str | None]:
        if cfg.cpu_reduce == "shared-memory":
            return SharedReduce.create(d, cfg.collective_timeout_s, os.path.basename(run_dir))
        return None, "distributed.cpu_reduce = gloo"

    def carry_table(self, exchange) -> None:
        self.wrapped.register_comm_hook(None, exchange.hook)

    def save(self, job: SaveJob) -> dict[str, Any] | None:
        return job.writer.start(
            job.step, job.reason, job.state, job.rank_state, job.best, job.requested, job.waited
        )

    def start_fields(self) -> dict[str, Any]:
        return {"ddp": settings(self.wrapped), "fsdp": None}


def settings(ddp) -> dict[str, Any]:
    """The settings the DDP object really holds, read back (not what we asked for)."""
    return {
        "static_graph": bool(getattr(ddp, "static_graph", False)),
        "bucket_cap_mb": ddp.bucket_bytes_cap / (1024 * 1024),
        "find_unused_parameters": ddp.find_unused_parameters,
        "broadcast_buffers": ddp.broadcast_buffers,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "sync_batchnorm": any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
    }
