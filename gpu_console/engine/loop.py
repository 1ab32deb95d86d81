"""The training loop: read it top to bottom.

setup → (resume) → for each step: grad_accum micro-steps, clip, update, schedule → at
log_every one small collective for loss and memory → eval / checkpoint / control at their
boundaries → end: eval, checkpoint, status. Rank 0 alone writes events.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..profile import Profile
from ..tasks.base import Task
from . import checkpoint, precision
from . import distributed as distmod
from .control import Control
from .data import Batches, DataPosition, make_loader
from .metrics import memory_sample
from .reporter import Reporter
from .schedule import lr_factor, scaled_lr

CONTROL_INTERVAL_S = 0.25


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class Window:
    """What happened since the last step event; kept on the device, synced at log time."""

    loss_sum: torch.Tensor
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy = "skip")
    started: float = field(default_factory=time.perf_counter)


def move(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move(v, device) for k, v in batch.items()}
    return batch


def train(run_dir: Path, profile: Profile, task: Task, device_type: str, resume: Path | None):
    p = profile
    d = distmod.init(p.distributed, p.hardware, device_type)
    out = Reporter(run_dir, d.is_main)
    try:
        _train(run_dir, p, task, d, out, resume)
    except BaseException as e:
        out.status("failed", reason=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        out.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(run_dir: Path, p: Profile, task: Task, d: distmod.Dist, out: Reporter, resume):
    out.status("starting")
    prec = precision.resolve(p.train.precision, d.device.type, distmod.cuda_capability())

    # -- model, optimizer, schedule ---------------------------------------------------------
    torch.manual_seed(p.train.seed)  # identical init on every rank
    model = task.build_model().to(d.device)
    lr = scaled_lr(p.train.lr, d.world_size, p.distributed.lr_scaling)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        weight_decay=p.train.weight_decay,
        fused=d.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, p.train))
    scaler = precision.make_scaler(prec, d.device.type)

    # -- data ----------------------------------------------------------------------------
    train_set, eval_set = task.build_datasets()
    cuda = d.device.type == "cuda"
    train_loader = make_loader(train_set, p.data, d.rank, d.world_size, True, cuda)
    eval_loader = (
        make_loader(eval_set, p.data, d.rank, d.world_size, False, cuda) if eval_set else None
    )

    # -- state: fresh, or resumed from a checkpoint --------------------------------------
    step, position = 0, DataPosition()
    random.seed(p.train.seed + d.rank)
    torch.manual_seed(p.train.seed + 1_000_003 * (d.rank + 1))  # per-rank dropout streams
    if resume is not None:
        state = checkpoint.load(resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step = int(state["step"])
        position = DataPosition(**state["data"])
        ranks = state.get("ranks") or []
        if len(ranks) == d.world_size:
            checkpoint.restore_rng(ranks[d.rank]["rng"], d.device)
        else:
            out.log("warning", f"resumed on {d.world_size} ranks from {len(ranks)}: RNG reseeded")
        out.log("info", f"resumed from {resume} at step {step}")

    ddp = distmod.wrap(model, p.distributed, d)
    batches = Batches(train_loader, position)
    control = Control(run_dir, d.is_main, d.device, CONTROL_INTERVAL_S)
    control.install_signal_handlers()
    autocast = precision.autocast(prec, d.device.type)
    params = [q for q in model.parameters() if q.requires_grad]

    def save(reason: str) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "step": step,
            "data": batches.position.state_dict(),
            "world_size": d.world_size,
        }
        rank_state = {"rng": checkpoint.capture_rng(d.device)}
        info = checkpoint.save(
            run_dir, step, reason, state, rank_state, p.checkpoint.keep_last, d.is_main
        )
        if info:
            out.event("checkpoint", **info)

    out.start(
        world_size=d.world_size,
        device_type=d.device.type,
        backend=d.backend,
        precision=prec,
        task=p.task_kind,
        params=sum(q.numel() for q in model.parameters()),
        max_steps=p.train.max_steps,
        start_step=step,
        global_batch=p.data.batch_size * p.train.grad_accum * d.world_size,
        lr=lr,
        ddp=_ddp_settings(ddp),
        threads=torch.get_num_threads(),
        versions={"torch": torch.__version__, "cuda": torch.version.cuda},
    )
    out.status("running")

    window = Window(loss_sum=torch.zeros((), device=d.device))
    last_loss = torch.zeros((), device=d.device)
    grad_norm = torch.zeros((), device=d.device)
    accum = p.train.grad_accum
    max_norm = p.train.clip_grad_norm if p.train.clip_grad_norm > 0 else math.inf
    skip_bad = p.train.nan_policy == "skip"
    paused = False

    # -- the loop ------------------------------------------------------------------------
    while step < p.train.max_steps:
        if not paused:
            last_loss.zero_()
            for micro in range(accum):
                batch = move(batches.next(), d.device)
                sync = contextlib.nullcontext() if micro == accum - 1 else ddp.no_sync()
                with sync:
                    with autocast:
                        result = task.compute(ddp, batch)
                    loss = result.loss / accum
                    (scaler.scale(loss) if scaler else loss).backward()
                last_loss += loss.detach()
                window.samples += result.samples
                window.tokens += result.tokens
            if scaler is not None:
                scaler.unscale_(optimizer)
            logging_next = (step + 1) % p.train.log_every == 0 or step + 1 == p.train.max_steps
            if max_norm < math.inf or logging_next or skip_bad:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            # The norm is of the all-reduced gradients, the same on every rank, so every rank
            # skips the same update with no collective of its own (but a host sync on GPU).
            if skip_bad and not torch.isfinite(grad_norm):
                window.skipped += 1
                if scaler is not None:
                    scaler.update()  # the scaler still learns from the overflow
            elif scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window.loss_sum += last_loss
            window.steps += 1

            if step % p.train.log_every == 0 or step == p.train.max_steps:
                _log_step(out, d, p, step, batches, scheduler, last_loss, grad_norm, window)
                window = Window(loss_sum=torch.zeros((), device=d.device))
            if eval_loader is not None and p.train.eval_every and step % p.train.eval_every == 0:
                _evaluate(out, d, task, ddp, eval_loader, autocast, step)
            if p.checkpoint.every_steps and step % p.checkpoint.every_steps == 0:
                save("interval")

        if not (paused or control.due(step)):
            continue
        if paused and d.is_main:
            time.sleep(CONTROL_INTERVAL_S)  # the other ranks wait in the check's collective
        decision = control.check(step)
        if decision.signalled:
            out.log("warning", f"signal received: stopping at step {step}")
            return _stop(out, p, step, save, "signal")
        if decision.cmd is None:
            continue
        out.event("control", id=decision.cmd_id, cmd=decision.cmd, state="received", step=step)
        if decision.cmd == "checkpoint":
            save("request")
        elif decision.cmd == "pause":
            if not paused:
                paused = True
                out.status("paused", reason="requested")
        elif decision.cmd == "resume":
            if paused:
                paused = False
                window = Window(loss_sum=torch.zeros((), device=d.device))
                out.status("running", reason="resumed")
        elif decision.cmd == "stop":
            control.stop_pending = True
            out.event("control", id=decision.cmd_id, cmd="stop", state="done", step=step)
            return _stop(out, p, step, save, "stop")
        out.event("control", id=decision.cmd_id, cmd=decision.cmd, state="done", step=step)

    # -- the end (skipping what the last step's boundaries already did) ----------------------
    if eval_loader is not None and not (p.train.eval_every and step % p.train.eval_every == 0):
        _evaluate(out, d, task, ddp, eval_loader, autocast, step)
    if p.checkpoint.at_end and not (
        p.checkpoint.every_steps and step % p.checkpoint.every_steps == 0
    ):
        save("end")
    out.status("finished", reason="max_steps reached")


def _stop(out: Reporter, p: Profile, step: int, save, reason: str) -> None:
    out.status("stopping", reason=reason)
    if p.checkpoint.on_stop:
        save(reason)
    out.status("stopped", reason=reason)


def _log_step(out, d, p, step, batches, scheduler, last_loss, grad_norm, window: Window) -> None:
    """The one collective of a log interval: loss, counts and memory of every rank."""
    mem = memory_sample(d.device)
    local = torch.tensor(
        [last_loss.item(), window.loss_sum.item(), window.samples, window.tokens],
        dtype=torch.float64,
        device=d.device,
    )
    dist.all_reduce(local)
    mems = [torch.zeros(3, dtype=torch.int64, device=d.device) for _ in range(d.world_size)]
    dist.all_gather(mems, torch.tensor(mem, dtype=torch.int64, device=d.device))
    loss, loss_sum, samples, tokens = local.tolist()
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    loss = loss / d.world_size
    if not math.isfinite(loss) and p.train.nan_policy == "stop":
        first = step - window.steps + 1
        where = f"step {step}" if first == step else f"steps {first}-{step}"
        raise NonFiniteLoss(f"loss is {loss} in {where} (train.nan_policy = 'stop')")
    if not d.is_main:
        return
    fields = {
        "step": step,
        "epoch": batches.position.epoch,
        "loss": loss,
        "loss_avg": loss_sum / d.world_size / max(window.steps, 1),
        "lr": scheduler.get_last_lr()[0],
        "grad_norm": float(grad_norm),
        "samples_per_s": samples / elapsed,
        "step_time_s": elapsed / max(window.steps, 1),
        "memory": [
            {"rank": r, "allocated": a, "reserved": b, "peak": c}
            for r, (a, b, c) in enumerate(m.tolist() for m in mems)
        ],
    }
    if tokens:
        fields["tokens_per_s"] = tokens / elapsed
    if p.train.nan_policy == "skip":
        fields["skipped"] = window.skipped
    out.event("step", **fields)


@torch.no_grad()
def _evaluate(out, d, task, ddp, loader, autocast, step: int) -> None:
    ddp.eval()
    totals: dict[str, float] = {}
    samples = 0
    for batch in loader:
        batch = move(batch, d.device)
        with autocast:
            result = task.compute(ddp.module, batch)
        n = result.samples
        samples += n
        totals["loss"] = totals.get("loss", 0.0) + float(result.loss) * n
        for name, value in result.metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
    ddp.train()
    # A rank with no eval batch (fewer samples than ranks) knows no metric names: agree on
    # them first, so every rank's buffer has the same shape. Eval is rare; this is cheap.
    every: list[list[str] | None] = [None] * d.world_size
    dist.all_gather_object(every, sorted(totals))
    names = sorted({n for ranks_names in every for n in ranks_names or []})
    values = [totals.get(k, 0.0) for k in names] + [samples]
    buf = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(buf)
    values = buf.tolist()
    n = max(values[-1], 1)
    if d.is_main:
        out.event("eval", step=step, **{k: v / n for k, v in zip(names, values[:-1], strict=True)})


def _ddp_settings(ddp) -> dict[str, Any]:
    """The settings the DDP object really holds, read back (not what we asked for)."""
    return {
        "static_graph": bool(getattr(ddp, "static_graph", False)),
        "bucket_cap_mb": ddp.bucket_bytes_cap / (1024 * 1024),
        "find_unused_parameters": ddp.find_unused_parameters,
        "broadcast_buffers": ddp.broadcast_buffers,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "sync_batchnorm": any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
    }
