"""``distributed.strategy = "ddp"``: every rank holds the whole model, DDP averages gradients.

A log step's table rides DDP's gradient all-reduce (a communication hook, exchange.py); CPU
ranks on one machine may sum through shared memory (shared_reduce.py). Checkpoints are the
whole state in plain files, written by rank 0 in the background (checkpoint_writer.py), and
loaded into the bare model before DDP wraps it.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, precision
from . import distributed as distmod
from .shared_reduce import SharedReduce
from .strategy import SaveJob, Strategy


class DdpStrategy(Strategy):
    name = "ddp"

    def __init__(self, cfg, d) -> None:
        self.cfg, self.d = cfg, d

    def make_scaler(self, precision_: str, device_type: str, init_scale: float) -> Any:
        return precision.make_scaler(precision_, device_type, init_scale)

    def load_before_wrap(self, point: Path, model, optimizers, scalers, d) -> Any:
        # The optimizers keep this profile's settings over the saved ones (optim_set.py).
        return checkpoint.resume(point, model, optimizers, scalers, d.rank, d.world_size)

    def wrap(self, model, task, precision_: str, optimizers, warn) -> None:
        self.wrapped = distmod.wrap(model, self.cfg, self.d)

    def clip(self, optimizers, max_norm: float) -> tuple[Any, dict[str, Any]]:
        return optimizers.clip(max_norm)

    def average_grads(self, params: list) -> None:
        # A task's own step runs the bare model (DDP's hooks never fire): averaged here, in
        # buckets of DDP's size.
        average(params, self.d.world_size, int(self.cfg.bucket_cap_mb * 1024 * 1024))

    def gradient_reduce(self, d, cfg, run_dir: Path) -> tuple[SharedReduce | None, str | None]:
        if cfg.cpu_reduce == "shared-memory":
            return SharedReduce.create(d, cfg.collective_timeout_s, os.path.basename(run_dir))
        return None, "distributed.cpu_reduce = gloo"

    def carry_table(self, exchange) -> None:
        # Only where it pays: on CPU a gloo collective costs ~1.5 ms however small, so the
        # log step's table rides the gradients' all-reduce. On GPUs a separate NCCL
        # all-reduce every log step costs microseconds, while a Python hook on every bucket
        # of every step would replace DDP's own C++ one (issue 39): DDP keeps its own there.
        if self.d.device.type == "cuda":
            return
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


IN_FLIGHT = 2  # buckets reduced at once: memory for two flattened buckets, not the model's


def average(params: list, world_size: int, bucket_bytes: int) -> None:
    """Every rank's gradients of ``params`` replaced by their mean, bucket by bucket (each
    at most ``bucket_bytes``, a larger tensor alone and in place), a few all-reduces in
    flight at once. A parameter this rank gave no gradient counts as zeros, so every rank
    sends the same shapes."""
    if world_size == 1 or not params:
        return
    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    pending: deque = deque()
    for bucket in _buckets([q.grad for q in params], bucket_bytes):
        alone = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if alone else torch.cat([g.reshape(-1) for g in bucket])
        flat.mul_(1.0 / world_size)  # as DDP: scaled as it is copied in, then summed
        pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
        if len(pending) >= IN_FLIGHT:
            _land(*pending.popleft())
    while pending:
        _land(*pending.popleft())


def _buckets(grads: list, bucket_bytes: int) -> list[list]:
    """Consecutive gradients of one dtype and device, up to ``bucket_bytes`` each."""
    out: list[list] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        same = bool(out) and (out[-1][0].dtype, out[-1][0].device) == (g.dtype, g.device)
        if same and size + nbytes <= bucket_bytes:
            out[-1].append(g)
            size += nbytes
        else:
            out.append([g])
            size = nbytes
    return out


def _land(bucket: list, flat: torch.Tensor, work) -> None:
    work.wait()
    if flat is bucket[0]:
        return
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
