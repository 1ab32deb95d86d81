"""The training loop: read it top to bottom.

setup → (resume) → for each step: grad_accum micro-steps, clip, update, schedule, the
task's step hooks → at log_every steps and control checks, the ranks' numbers (loss,
memory, commands, signals) ride with the gradients' all-reduce (exchange.py) → eval /
checkpoint / control at their boundaries → end: eval, checkpoint, the task's end hook,
status. The task's context and hooks: context.py, hooks.py. Rank 0 alone writes events (on
several nodes: the first rank of each node, into its node's run directory).

What can go wrong, and what the loop does about it:

- A scheduler signal (SIGTERM/SIGUSR1, see signals.py): every rank stops at the same step
  boundary, checkpoints (reason ``signal``) and exits 0.
- A non-finite loss with ``nan_policy = "stop"``: the gradient norm (all-reduced, so the
  same on every rank) is checked before each update; the first non-finite one stops every
  rank before the update, checkpoints the last finite state (reason ``nan``), then fails
  naming the step. (With an fp16 GradScaler, inf/nan gradients are the scaler's business and
  the loss is checked at each log interval instead.) On GPUs the check gates the update on
  the device and the host reads it at the next step where it syncs anyway (nonfinite.py).
- CUDA out of memory: the rank fails with its peak memory and what to change (and, with
  ``hardware.memory_snapshot_on_oom``, a CUDA memory snapshot named in the failure).
- A checkpoint that cannot be written (a full disk): the previous one stays complete and
  named in LATEST; an error event says so and the run goes on (a stop then ends without a
  checkpoint, which the supervisor records). Writes run in the background
  (checkpoint_writer.py): a failed one is reported at the next step boundary.
- A restart by torchrun (``distributed.max_restarts``): the run resumes from its own LATEST.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..profile import Profile
from ..runs import latest_checkpoint, write_nodes
from ..tasks.base import Task
from ..timings import Stopwatch
from . import (
    activation_checkpoint,
    auto_batch,
    checkpoint,
    determinism,
    flops,
    fsdp,
    precision,
    sharded_checkpoint,
    signals,
    task_step,
    torch_profiler,
)
from . import context as contexts
from . import distributed as distmod
from . import resume as resuming
from .best import resumed as best_so_far
from .checkpoint_writer import Writer
from .compile import Compiled, mode_of
from .control import Control
from .data import Batches, DataPosition, make_loader, move
from .evaluate import at_start as eval_at_start
from .evaluate import evaluate
from .evaluate import splits as eval_splits
from .exchange import Exchange, Row
from .heartbeat import Heartbeat
from .hooks import Hooks, attach
from .metrics import memory_sample
from .nonfinite import Guard, rewind_schedule
from .optim_set import Optimizers
from .reporter import Reporter
from .schedule import scaled_lr
from .shared_reduce import SharedReduce
from .train_metrics import TrainMetrics

CONTROL_INTERVAL_S = 0.25


class NonFiniteLoss(RuntimeError):
    pass


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory on this rank; the message says how much and what to change."""


class _NullHeartbeat:
    step = 0
    phase = "starting"

    def set(self, step: int, phase: str, detail: str = "") -> None:
        self.step = step


@dataclass
class Window:
    """What happened since the last step event; kept on the device, synced at log time."""

    loss_sum: torch.Tensor
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy = "skip")
    started: float = field(default_factory=time.perf_counter)


def train(
    run_dir: Path,
    profile: Profile,
    task: Task,
    device_type: str,
    resume: Path | None,
    heartbeat: Heartbeat | None = None,
    restart: int = 0,
    changes: list[dict] | None = None,
    stopwatch: Stopwatch | None = None,
):
    p = profile
    watch = stopwatch or Stopwatch()
    signals.install()  # already done by __main__ before torch loaded; harmless again
    determinism.setup(p.train.deterministic)  # before anything touches CUDA
    d = distmod.init(p.distributed, p.hardware, device_type)
    watch.mark("process_group")
    out = Reporter(run_dir, d.local_rank == 0)
    beat = heartbeat or _NullHeartbeat()
    oom_snapshot = torch_profiler.record_memory_history(p.hardware.memory_snapshot_on_oom, d.device)
    try:
        try:
            _train(
                run_dir, p, task, d, out, resume, beat, restart, changes or [], watch, oom_snapshot
            )
        except torch.OutOfMemoryError as e:  # torch.cuda.OutOfMemoryError is this class
            snapshot = torch_profiler.dump_memory_snapshot(run_dir, d.rank, oom_snapshot)
            # The step the loop was in (its heartbeat knows), counted from 1 like step events.
            raise OutOfMemory(oom_message(e, d, p, beat.step, snapshot)) from e
    except NonFiniteLoss as e:
        # A policy decision every rank made at the same step, not a crash: a restart would
        # not help, so the ranks exit 0 and the status says failed (the supervisor records
        # the engine's reason as the failure).
        out.status("failed", reason=f"NonFiniteLoss: {e}"[:500], step=_done_step(beat))
    except BaseException as e:
        # With restarts left, torchrun starts the group again (from LATEST): not the end.
        again = restart < p.distributed.max_restarts
        out.status(
            "restarting" if again else "failed",
            reason=f"{type(e).__name__}: {e}"[:500],
            step=_done_step(beat),
        )
        if isinstance(e, OutOfMemory):
            out.log("error", str(e))
        raise
    finally:
        torch_profiler.after_failure()  # a capture a failure cut short writes what it has
        close_task(task, out, d.rank)
        out.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def close_task(task: Task, out: Reporter, rank: int) -> None:
    """The task's optional ``close()``: on every rank, however the run ended.

    Its failure is reported (a warning event, the traceback on the rank's stderr) and does
    not change how the run ended: the run's status is already written.
    """
    close = getattr(task, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as e:
        traceback.print_exc()
        out.log("warning", f"the task's close() failed on rank {rank}: {type(e).__name__}: {e}")


def resume_point(run_dir: Path, requested: Path | None, restart: int, d) -> Path | None:
    """Where to start from, decided by rank 0 and shared with every rank.

    After a restart by torchrun, the run's own newest complete checkpoint (else what the run
    was started from); otherwise ``--resume``'s. On several nodes the path is rank 0's: the
    other nodes must see it (a shared runs directory) or they fail here, saying so.
    """
    choice: list[str | None] = [None]
    if d.is_main:
        path = requested
        if restart > 0:
            path = latest_checkpoint(run_dir) or requested
        choice[0] = str(Path(path).resolve()) if path else None
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path = Path(choice[0])
    if not (path / checkpoint.STATE).is_file():
        raise FileNotFoundError(
            f"rank {d.rank} cannot read rank 0's checkpoint {path}: on several nodes, resuming "
            "needs a runs directory every node can read (a shared file system)"
        )
    return path


def _train(
    run_dir: Path,
    p: Profile,
    task: Task,
    d,
    out: Reporter,
    resume,
    beat,
    restart: int,
    changes,
    watch: Stopwatch,
    oom_snapshot: str = "off",
):
    out.status("starting")
    resume = resume_point(run_dir, resume, restart, d)
    # Several nodes: where each one's run directory is. Rank 0's holds the checkpoints; every
    # node's console reads the others' telemetry through nodes.json (a shared file system).
    nodes = distmod.nodes_of_run(run_dir, d) if d.world_size > d.local_world_size else []
    rank_0 = next(
        ({"host": n["host"], "run_dir": n["run_dir"]} for n in nodes if n["rank"] == 0), None
    )
    if nodes and out.active:
        with contextlib.suppress(OSError):  # only the other nodes' telemetry depends on it
            write_nodes(run_dir, nodes)
    prec = precision.resolve(p.train.precision, d.device.type, distmod.cuda_capability())
    sharded = p.distributed.strategy == "fsdp"  # FSDP2 in place of DDP (fsdp.py)

    # -- model, optimizer, schedule ---------------------------------------------------------
    ctx = contexts.make(d, run_dir, p, resume is not None, checkpoint.step_of(resume), out)
    attach(task, ctx)
    hooks = Hooks(task, ctx)
    torch.manual_seed(p.train.seed)  # identical init on every rank
    model = task.build_model().to(d.device)
    lr = scaled_lr(p.train.lr, d.world_size, p.distributed.lr_scaling)
    # The task's configure_optimizers(), else train.optimizer: every one by name.
    opts = Optimizers.build(task, model, p, d.world_size, d.device.type, ctx)
    scaler = (fsdp if sharded else precision).make_scaler(prec, d.device.type)
    # A task's own train_step makes its updates through this (task_step.py), else None.
    owned = task_step.for_task(task, opts, p.train, d, scaler)
    scalers = owned.scalers if owned is not None and owned.scalers else scaler

    # -- data ----------------------------------------------------------------------------
    train_set, eval_set = task.build_datasets()
    cuda = d.device.type == "cuda"
    collate = getattr(task, "collate", None)  # the task's own, else data.collate_of's rule
    batch_search, held = None, None
    if p.data.batch_size == "auto":  # searched on real steps, agreed by every rank
        # The search measures the model as it trains: its blocks checkpointed already (the
        # bytes held without and with are then not measured: no micro-batch size yet).
        held = activation_checkpoint.setup(
            task, model, p.train.activation_checkpointing, lambda m: None
        )
        if held is not None:
            held["not_measured"] = "data.batch_size = auto: checkpointed before the search"
        data = (train_set, collate)
        batch_search = auto_batch_size(
            run_dir, p, task, model, opts, owned, d, prec, out, ctx, data
        )
    train_loader = make_loader(train_set, p.data, d.rank, d.world_size, True, cuda, collate)
    eval_loader = {  # by split (evaluate.py); empty: no eval
        split: make_loader(
            s, p.data, d.rank, d.world_size, False, cuda, collate, p.data.eval_batch_size
        )
        for split, s in eval_splits(eval_set).items()
    }

    # -- state: fresh, or resumed from a checkpoint --------------------------------------
    step, position = 0, DataPosition()
    evaluated_at: int | None = None  # the step of the newest eval (saved for eval_at_start)
    random.seed(p.train.seed + d.rank)
    torch.manual_seed(p.train.seed + 1_000_003 * (d.rank + 1))  # per-rank dropout streams
    if resume is not None and not sharded:  # an FSDP run's once sharded, below
        # The optimizers keep this profile's settings over the saved ones (optim_set.py).
        back = checkpoint.resume(resume, model, opts, scalers, d.rank, d.world_size)
        step, evaluated_at, position = _resumed(back, resume, d, p, changes, hooks, out)

    watch.mark("built")
    autocast = precision.autocast(prec, d.device.type)
    # MFU: FLOPs per sample (the task's count, else measured once on the bare model by the
    # rank that writes events) against the GPUs' peak (peaks.py).
    mfu = flops.setup(task, model, train_loader, prec, d.world_size, autocast, move, out.active)
    # Activation checkpointing wraps the task's blocks in place; measured off and on by the
    # same rank on one micro-batch (activation_checkpoint.py).
    held = held if batch_search is not None else activation_checkpoint.setup(
        task, model, p.train.activation_checkpointing,
        lambda m: activation_checkpoint.held_bytes(
            task, m, move(flops.sample_batch(train_loader), d.device), autocast
        ) if out.active else None,
    )  # fmt: skip
    # Compiled in place before DDP wraps it: the names and checkpoints stay (compile.py).
    compiled = Compiled(mode_of(p.train.compile))
    compiled.apply(model)

    if sharded:
        ddp = fsdp.shard(model, task, p.distributed, prec, opts, lambda m: out.log("warning", m))
        autocast = contextlib.nullcontext()  # FSDP's mixed precision casts instead (fsdp.py)
        if owned is not None:
            owned.sharded = True
        if resume is not None:
            back = sharded_checkpoint.resume(resume, model, opts, scalers, d.rank, d.world_size)
            step, evaluated_at, position = _resumed(back, resume, d, p, changes, hooks, out)
    else:
        ddp = distmod.wrap(model, p.distributed, d)
    net = ddp.module if sharded else ddp  # what the task's compute is handed
    shared, why_not = None, "distributed.cpu_reduce = gloo"
    if sharded:
        why_not = "distributed.strategy = fsdp: gradients are reduce-scattered by FSDP"
    elif p.distributed.cpu_reduce == "shared-memory":
        shared, why_not = SharedReduce.create(
            d, p.distributed.collective_timeout_s, os.path.basename(run_dir)
        )
    exchange = Exchange(d.rank, d.world_size, d.device, shared)
    # The task's train-time metrics ride in the log step's exchange (train_metrics.py).
    train_metrics = TrainMetrics(
        task, d.rank, d.world_size, d.device, lambda m: out.log("warning", m)
    )
    if not sharded:  # under FSDP a log step's table takes a collective of its own
        ddp.register_comm_hook(None, exchange.hook)
    batches = Batches(train_loader, position)
    hooks.start(step, batches)
    control = Control(run_dir, d.local_rank == 0, CONTROL_INTERVAL_S)
    profiler = torch_profiler.Profiler(run_dir, d, out)  # the profile command (torch_profiler.py)
    writes = checkpoint.write_group(p.distributed.collective_timeout_s)
    # checkpoint.async_write: training waits for a copy of the state, a thread writes it.
    writer = Writer(run_dir, d.device, d.is_main, writes, p.checkpoint.keep_last,
                    p.checkpoint.async_write)  # fmt: skip
    newest = checkpoint.Newest()
    best = best_so_far(p.checkpoint.keep_best, p.checkpoint.best_direction(), resume, run_dir)
    if best.on and not eval_loader:
        out.log("warning", f"checkpoint.keep_best = {best.metric!r}: the task has no eval set")

    def save(reason: str | None, wait: bool = True) -> bool:
        """Collective. False when rank 0 could not write it (the previous one stays).

        The write in flight is waited for first (one at a time). ``wait=False`` (interval
        and best checkpoints): return once the state is copied, the outcome is settled at a
        later step boundary. ``reason=None``: only wait for the write in flight.
        """
        requested = time.perf_counter()
        beat.set(step, "checkpoint")
        settle(writer.wait())
        waited = time.perf_counter() - requested
        if reason is None:
            return True
        state = {
            "model": model.state_dict(),
            **opts.state_dict(),  # every optimizer and schedule, by name
            "scaler": checkpoint.scaler_state(scalers),  # one, or one per optimizer
            "step": step,
            "data": batches.position.state_dict(),
            "world_size": d.world_size,
            "evaluated_at": evaluated_at,
        }
        rank_state = {"rng": checkpoint.capture_rng(d.device), **hooks.state()}
        if sharded:  # every rank writes its shards through DCP, synchronously
            outcome = sharded_checkpoint.save(
                run_dir, step, reason, model, opts, state, rank_state, p.checkpoint.keep_last,
                d.is_main, writes, best.for_save(step),
            )  # fmt: skip
            return settle({**outcome, "step": step, "reason": reason})
        outcome = writer.start(
            step, reason, state, rank_state, best.for_save(step), requested, waited
        )
        if outcome is None and not wait:
            return True
        return settle(outcome or writer.wait())

    def settle(outcome: dict[str, Any] | None) -> bool:
        """A write's outcome, the same on every rank: its event, or its failure reported."""
        if outcome is None:
            return True
        if outcome["ok"]:
            newest.event = outcome["event"]
            if d.is_main:
                out.event("checkpoint", **outcome["event"])
            return True
        # Every node's first rank says so: each node's status records the stop as unsaved.
        message, failed = checkpoint.failure(outcome["step"], outcome["reason"], outcome)
        out.log("error", message, checkpoint_failed=failed)
        return False

    watch.mark("ddp")
    out.start(
        world_size=d.world_size,
        device_type=d.device.type,
        backend=d.backend,
        precision=prec,
        task=p.task_kind,
        params=sum(q.numel() for q in model.parameters()),
        max_steps=p.train.max_steps,
        start_step=step,
        restart=restart,
        max_restarts=p.distributed.max_restarts,
        resumed_from=str(resume) if resume else None,
        changes=changes if resume else [],  # against the run resumed, classified at launch
        # Several machines: this node's place (torchrun's group rank) and where rank 0 is,
        # which writes the checkpoints and reads commands alongside each node's first rank.
        node=int(os.environ.get("GROUP_RANK", 0)),
        nodes=d.world_size // max(d.local_world_size, 1),
        rank_0=rank_0,
        batch_size=p.data.batch_size,  # per rank per micro-batch
        auto_batch=batch_search,  # how data.batch_size = "auto" was chosen, else None
        global_batch=p.data.batch_size * p.train.grad_accum * d.world_size,
        lr=lr,
        optimizer=opts.summary(),
        optimizers=opts.describe(),  # what was built: classes, groups, schedules
        train_step="task" if owned is not None else "engine",  # who runs backward and step
        weight_decay=opts.decay.fields() if opts.decay else None,
        strategy=p.distributed.strategy,
        ddp=None if sharded else _ddp_settings(ddp),
        fsdp=ddp.settings() if sharded else None,
        # How gradients are summed: what a CPU run's speed depends on most.
        reduce="shared memory" if shared else f"{d.backend} ({why_not})",
        threads=torch.get_num_threads(),
        deterministic=determinism.in_effect(p.train.deterministic),
        versions={"torch": torch.__version__, "cuda": torch.version.cuda},
        **mfu.start_fields(),
        **compiled.start_fields(),
        activation_checkpointing=held or p.train.activation_checkpointing,
        **watch.start_fields(),  # where the start-up time went (timings.py)
        memory_snapshot_on_oom=oom_snapshot,  # on, off, or why it has no effect
    )
    if oom_snapshot not in ("on", "off"):
        out.log("warning", f"hardware.memory_snapshot_on_oom = true: {oom_snapshot}")
    compiled.begin(out.status)  # "compiling" until the first step completes, else "running"

    window = Window(loss_sum=torch.zeros((), device=d.device))
    grad_norm = torch.zeros((), device=d.device)
    grad_norms: dict[str, torch.Tensor] = {}
    accum = p.train.grad_accum
    max_norm = p.train.clip_grad_norm if p.train.clip_grad_norm > 0 else math.inf
    guard = Guard(p.train.nan_policy, [e.optimizer for e in opts.entries], scaler, d.device)
    if not opts.rewindable() or owned is not None:  # a torch scheduler cannot step back
        guard.deferred = False
    skip_bad, stop_bad = guard.skip, guard.stop
    paused = False

    def log_step(n: int) -> bool:
        return n % p.train.log_every == 0 or n == p.train.max_steps

    def boundary(n: int) -> bool:
        """A step after which the host syncs anyway (log, control, eval, checkpoint)."""
        return (
            log_step(n)
            or control.due(n)
            or bool(eval_loader and p.train.eval_every and n % p.train.eval_every == 0)
            or bool(p.checkpoint.every_steps and n % p.checkpoint.every_steps == 0)
        )

    def run_eval() -> bool:
        """Collective: one eval at ``step``, its metrics to the schedules and hooks; improved?"""
        nonlocal evaluated_at
        evaluated_at = step
        beat.set(step, "eval")
        with compiled.eager():
            metrics = evaluate(out, d, task, ddp, eval_loader, autocast, step, move, beat)
        opts.after_eval(metrics)
        hooks.eval_end(model, metrics)
        return best.observe(step, metrics, lambda m: out.log("warning", m))

    if eval_loader and eval_at_start(p.train.eval_at_start, step, evaluated_at, p.train.eval_every):
        run_eval()  # train.eval_at_start: the model before this session's first step

    # -- the loop ------------------------------------------------------------------------
    while step < p.train.max_steps:
        settle(writer.finished())  # a background write that ended: its event, or its failure
        if paused:
            beat.set(step, "paused")
            if d.local_rank == 0:
                time.sleep(CONTROL_INTERVAL_S)  # the other ranks wait in the exchange
            rows = exchange.control_only(control.proposal(step))
        else:
            # A log step's numbers ride with its gradients' all-reduce: every rank knows the
            # log steps beforehand, so all carry the table at the same steps, and a resumed
            # run carries it at the same steps as an uninterrupted one.
            logging = log_step(step + 1)
            last_loss = None
            for micro in range(accum):
                beat.set(step + 1, "data")  # the step in progress
                batch = move(batches.next(), d.device)
                beat.set(step + 1, "compute")
                final = micro == accum - 1
                # A task's own step averages at its end (under FSDP: reduces every backward).
                unsynced = not final and owned is None
                with ddp.no_sync() if unsynced else contextlib.nullcontext():
                    with autocast:
                        result = (
                            owned.run(task, ddp.module, batch, final, ctx, step)
                            if owned is not None  # its backward and updates happen in it
                            else task.compute(net, batch)
                        )
                    loss = result.loss if accum == 1 else result.loss / accum
                    part = loss.detach()
                    last_loss = part if last_loss is None else last_loss + part
                    window.samples += result.samples
                    window.tokens += result.tokens
                    train_metrics.add(result)
                    if final and logging:
                        exchange.prepare(
                            [last_loss, window.loss_sum + last_loss],
                            [window.samples, window.tokens, *memory_sample(d.device)]
                            + list(control.proposal(step + 1)),
                            train_metrics.columns(),
                        )
                    if owned is None:
                        (scaler.scale(loss) if scaler else loss).backward()
            beat.set(step + 1, "update")
            if owned is not None:
                grad_norm, grad_norms, skipped = owned.finish()
                window.skipped += skipped
            else:
                if scaler is not None:
                    opts.unscale(scaler)
                if max_norm < math.inf or logging or skip_bad or stop_bad:
                    # Each optimizer's on its own; FSDP's gradients are shards (fsdp.py).
                    grad_norm, grad_norms = (
                        fsdp.clip(opts, max_norm) if sharded else opts.clip(max_norm)
                    )
                # The norm is of the all-reduced gradients, the same on every rank, so every
                # rank skips (or stops before) the same update with no collective of its own.
                # On GPUs the verdict gates the update on the device, read at the next boundary.
                bad = guard.bad_now(grad_norm, last_loss, batches.position)
                if stop_bad and bad:
                    opts.zero_grad()
                    _stop_non_finite(out, d, p, step, save, last_loss, grad_norm)
                if skip_bad and bad:
                    window.skipped += 1
                    if scaler is not None:
                        scaler.update()  # the scaler still learns from the overflow
                else:
                    opts.step(scaler)
            opts.schedule()
            opts.zero_grad()
            step += 1
            watch.step_done()
            compiled.first_step_done(out.status, out.log)
            window.loss_sum += last_loss
            window.steps += 1
            if guard.deferred and boundary(step):
                settled = guard.settle()
                window.skipped += settled.skipped
                if settled.trip is not None:  # stop: back to the last finite step, then stop
                    step -= settled.trip.steps_back
                    for e in opts.entries:
                        if e.scheduler is not None:
                            rewind_schedule(e.scheduler, settled.trip.steps_back)
                    batches.position = DataPosition(*settled.trip.position)
                    _stop_non_finite(out, d, p, step, save, settled.trip.loss, settled.trip.norm)
            hooks.step_end(step, batches, model, result)
            profiler.step_end(step)  # a capture in progress moves on, or ends and is written

            rows = None
            if logging:
                beat.set(step, "sync")
                rows = exchange.gather()
                compiled.check(out.log)
                try:
                    _log_step(
                        out,
                        d,
                        p,
                        step,
                        batches,
                        opts,
                        rows,
                        grad_norm,
                        grad_norms,
                        window,
                        mfu,
                        watch,
                        train_metrics,
                        compiled,
                    )
                except NonFiniteLoss as e:
                    _fail_non_finite(out, d, p, step, save, model, e)
                window = Window(loss_sum=torch.zeros((), device=d.device))
                train_metrics.reset()
            improved = False
            if eval_loader and p.train.eval_every and step % p.train.eval_every == 0:
                improved = run_eval()
            if why := checkpoint.due(step, p.checkpoint, p.train.max_steps, improved):
                save(why, wait=False)
            if rows is None:
                # Between log steps (when they are further apart than the control interval),
                # a check of its own: one small collective, at a step rank 0's clock chose.
                if not control.due(step):
                    continue
                beat.set(step, "control")
                rows = exchange.control_only(control.proposal(step))

        decision = control.decide(
            step, [(r.cmd, r.signalled, r.next_check, r.cmd_arg) for r in rows]
        )
        while control.warnings:
            out.log("warning", control.warnings.pop(0))
        if decision.signalled:
            out.log("warning", f"signal received: stopping at step {step}")
            profiler.finish(step, "signal")
            return _stop(out, p, step, save, "signal", exchange.counts(), hooks, model)
        if decision.cmd is None:
            continue
        _ack(out, decision, "received", step)
        done = {}
        if decision.cmd == "checkpoint":
            save(None)  # a write in flight of this step answers the request once complete
            if newest.at(step) is None:  # else this step's checkpoint answers the request
                save("request")
            if newest.at(step) is not None:
                done["checkpoint"] = newest.at(step)
        elif decision.cmd == "pause":
            if not paused:
                profiler.finish(step, "pause")  # a paused run makes no steps to trace
                paused = True
                out.status("paused", reason="requested")
        elif decision.cmd == "resume":
            if paused:
                paused = False
                window = Window(loss_sum=torch.zeros((), device=d.device))
                out.status("running", reason="resumed")
        elif decision.cmd == "profile":  # acknowledged when the traces are written
            profiler.request(
                step, decision.arg, paused, lambda *a, c=decision, **f: _ack(out, c, *a, **f)
            )
            continue
        elif decision.cmd == "stop":
            control.stopping()
            profiler.finish(step, "stop")
            _ack(out, decision, "done", step)
            return _stop(out, p, step, save, "stop", exchange.counts(), hooks, model)
        _ack(out, decision, "done", step, **done)

    # -- the end (skipping what the last step's boundaries already did) ----------------------
    profiler.finish(step, "end")
    improved = False
    if eval_loader and not (p.train.eval_every and step % p.train.eval_every == 0):
        improved = run_eval()
    if p.checkpoint.at_end:
        save("end")
    elif improved:
        save("best")
    save(None)  # a write still in flight ends before the run does
    hooks.train_end(model, "finished")
    out.status("finished", reason="max_steps reached", step=step, exchanges=exchange.counts())


def _resumed(back, resume: Path, d, p: Profile, changes, hooks: Hooks, out: Reporter):
    """A loaded checkpoint's step, newest eval and data position; its task state and RNG
    restored."""
    position = resuming.position_of(back.data, back.world_size, changes, p.data.batch_size)
    hooks.restore(back.task, d.world_size, lambda m: out.log("warning", m))
    if back.rng is not None:
        checkpoint.restore_rng(back.rng, d.device)
    else:
        out.log("warning", f"resumed on {d.world_size} ranks from {back.ranks}: RNG reseeded")
    out.log(
        "info",
        f"resumed from {resume} at step {back.step} "
        f"(epoch {position.epoch}, sample {position.samples} of its order)",
    )
    return back.step, back.evaluated_at, position


def auto_batch_size(run_dir, p: Profile, task, model, opts, owned, d, prec, out, ctx, data):
    """``data.batch_size = "auto"``: search (auto_batch.py), then record the number in this
    node's run.toml (a restart or a resume reads it there) and say it."""
    autocast = precision.autocast(prec, d.device.type)
    report = auto_batch.choose(p, task, model, opts, owned, d, autocast, data, ctx)
    if d.local_rank == 0:
        auto_batch.write_run_toml(run_dir, p.data.batch_size)
    out.log("info", auto_batch.describe(report))
    return report


def _ack(out: Reporter, decision, state: str, step: int, **fields) -> None:
    """Acknowledge a command on the node whose control file held it (cmd_id is None elsewhere)."""
    if decision.cmd_id is not None:
        out.event("control", id=decision.cmd_id, cmd=decision.cmd, state=state, step=step,
                  **fields)  # fmt: skip


def _stop(out: Reporter, p: Profile, step: int, save, reason: str, exchanges, hooks, model):
    out.status("stopping", reason=reason)
    saved = save(reason) if p.checkpoint.on_stop else save(None)  # None: the write in flight
    hooks.train_end(model, "signal" if reason == "signal" else "stopped")
    # ``checkpointed`` is false only when a checkpoint was due and could not be written: the
    # supervisor then records the stop as interrupted (exit 130), not as a clean stop.
    out.status("stopped", reason=reason, step=step, checkpointed=saved, exchanges=exchanges)


def _done_step(beat) -> int:
    """The last step completed: the heartbeat's step is in progress in its first phases."""
    return beat.step - 1 if beat.phase in ("data", "compute", "update") else beat.step


def _stop_non_finite(out, d, p: Profile, step: int, save, last_loss, grad_norm) -> None:
    """Every rank is here together (the gradient norm is global): save, then fail."""
    loss = last_loss.detach().clone().to(torch.float64)
    dist.all_reduce(loss)
    loss_v = loss.item() / d.world_size
    bad = step + 1  # the update that would have been made
    what = (
        f"loss is {loss_v}"
        if not math.isfinite(loss_v)
        else f"gradient norm is {float(grad_norm)} (loss {loss_v:.6g})"
    )
    where = f"{what} in step {bad} (train.nan_policy = 'stop')"
    if p.checkpoint.on_stop and step > 0:
        out.status("stopping", reason="nan")
        saved = save("nan")
        kept = (
            f"; checkpoint {checkpoint.step_dir_name(step)} holds the last finite state"
            if saved
            else "; the checkpoint of the last finite state could not be written"
        )
    else:
        save(None)  # the write in flight ends first
        kept = "; no checkpoint written (checkpoint.on_stop = false)" if step else ""
    raise NonFiniteLoss(where + kept)


def _fail_non_finite(out, d, p: Profile, step: int, save, model, error: NonFiniteLoss) -> None:
    """A non-finite loss seen at a log step: keep the weights if they are still finite."""
    finite = torch.tensor(
        [float(all(bool(torch.isfinite(fsdp.local(q)).all()) for q in model.parameters()))],
        device=d.device,
    )
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if p.checkpoint.on_stop and finite.item() == 1.0:
        out.status("stopping", reason="nan")
        if save("nan"):
            raise NonFiniteLoss(
                f"{error}; checkpoint {checkpoint.step_dir_name(step)} holds the weights, "
                "which are still finite"
            ) from None
    save(None)  # the write in flight ends first
    raise error


ADVICE = (
    "lower data.batch_size (now {bs}) and raise train.grad_accum (now {ga}) to keep the "
    "global batch; {prec}activation checkpointing in the task's model "
    "(torch.utils.checkpoint); a smaller model"
)


def oom_message(
    e: BaseException, d, p: Profile, bad_step: int, snapshot: Path | None = None
) -> str:
    """What ran out, how much this rank had at its peak, and what to change."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    peak = total = None
    if d.device.type == "cuda":
        with contextlib.suppress(Exception):
            peak = torch.cuda.max_memory_allocated(d.device)
            total = torch.cuda.get_device_properties(d.device).total_memory
            torch.cuda.empty_cache()
    else:
        peak = memory_sample(d.device)[2]
    where = f"rank {d.rank} ran out of memory on {d.device} in step {bad_step}"
    sizes = ""
    if peak is not None:
        sizes = f"; peak {_gib(peak)}" + (f" of {_gib(total)}" if total else "")
    full = p.train.precision == "fp32" or (p.train.precision == "auto" and d.device.type == "cpu")
    lower = f"train.precision = bf16 (now {p.train.precision}); " if full else ""
    advice = ADVICE.format(bs=p.data.batch_size, ga=p.train.grad_accum, prec=lower)
    if snapshot is not None:  # first: the status keeps a reason's first 500 characters
        where += f" (CUDA memory snapshot: {snapshot}, open it in pytorch.org/memory_viz)"
    return f"{where} ({first}){sizes}. To fit: {advice}"


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _log_step(
    out,
    d,
    p,
    step,
    batches,
    opts,
    rows: list[Row],
    grad_norm,
    grad_norms,
    window,
    mfu,
    watch,
    train_metrics,
    compiled,
) -> None:
    """A step event from every rank's numbers, which came with the step's exchange."""
    loss = sum(r.last_loss for r in rows) / d.world_size
    loss_sum = sum(r.loss_sum for r in rows)
    samples = sum(r.samples for r in rows)
    tokens = sum(r.tokens for r in rows)
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    if not math.isfinite(loss) and p.train.nan_policy == "stop":
        first = step - window.steps + 1
        where = f"step {step}" if first == step else f"steps {first}-{step}"
        raise NonFiniteLoss(f"loss is {loss} in {where} (train.nan_policy = 'stop')")
    if not out.active:
        return
    lrs = opts.lrs()
    fields = {
        "step": step,
        "epoch": batches.position.epoch,
        "loss": loss,
        "loss_avg": loss_sum / d.world_size / max(window.steps, 1),
        "lr": lrs[opts.entries[0].name],
        "grad_norm": float(grad_norm),
        "samples_per_s": samples / elapsed,
        "step_time_s": elapsed / max(window.steps, 1),
        "memory": [
            {"rank": i, "allocated": r.allocated, "reserved": r.reserved, "peak": r.peak}
            for i, r in enumerate(rows)
        ],
    }
    if len(lrs) > 1:  # several optimizers: each one's lr and gradient norm
        fields["lrs"] = lrs
        fields["grad_norms"] = {k: float(v) for k, v in grad_norms.items()}
    if tokens:
        fields["tokens_per_s"] = tokens / elapsed
    if (util := mfu.of(samples / elapsed)) is not None:
        fields["mfu"] = util
    if p.train.nan_policy == "skip":
        fields["skipped"] = window.skipped
    if metrics := train_metrics.reduced([r.extra for r in rows]):
        fields["metrics"] = metrics  # the task's, reduced as it declares (train_metrics.py)
    fields.update(compiled.step_fields())
    out.event("step", **fields, **watch.first_step_fields())  # the first one: its timings


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
