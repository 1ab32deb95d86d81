"""The build phase: from a profile and a task to the parts the trainer calls.

In order (every rank the same, so the collectives among them meet): where to resume from;
the task's context, model and optimizers; the strategy's scaler and the update step; the
data (``data.batch_size = "auto"`` searched on real steps first); the seeds, and a plain
checkpoint loaded into the bare model; FLOPs, activation checkpointing and compile on the
bare model; the strategy's wrap (and a sharded checkpoint loaded into it); then the pieces
of the loop (exchange, control, profiler, checkpointer, evaluator, step logger).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..devices import fused_steps_ok
from ..profile import Profile
from ..runs import write_nodes
from ..tasks.base import Task
from ..timings import Stopwatch
from . import activation_checkpoint, auto_batch, checkpoint, flops, precision, torch_profiler
from . import context as contexts
from . import distributed as distmod
from . import resume as resuming
from .cadence import Cadence
from .checkpointer import Checkpointer, Saved
from .compile import Compiled, mode_of
from .control import Control
from .control_handler import CONTROL_INTERVAL_S, ControlHandler
from .data import Batches, DataPosition, make_loader, move
from .early_stop import KEY as EARLY_KEY
from .early_stop import EarlyStop
from .epoch_clock import EpochClock
from .evaluate import Evaluator, without_compute
from .evaluate import splits as eval_splits
from .exchange import Exchange
from .failure_checkpoint import FailureCheckpoint
from .hooks import Hooks
from .memory_watch import MemoryWatch
from .nan_stop import NanStop
from .optim_set import Optimizers
from .refusal import Refused
from .schedule import scaled_lr
from .step_log import Parts as LogParts
from .step_log import StepLogger
from .strategy import Strategy, closure_refused, for_profile
from .task_parts import TaskParts
from .timeouts import PhaseTimeouts
from .train_metrics import TrainMetrics
from .train_state import TrainState
from .update_step import Updater, for_task

if TYPE_CHECKING:
    from .context import TaskContext
    from .distributed import Dist
    from .flops import MFU
    from .heartbeat import Beat
    from .reporter import Reporter


@dataclass
class Setup:
    """What a rank's run starts from."""

    run_dir: Path
    p: Profile
    task: Task
    d: Dist
    out: Reporter
    resume: Path | None  # --resume's checkpoint (a restart picks the run's own LATEST)
    beat: Beat
    restart: int = 0
    changes: list[dict] = field(default_factory=list)
    watch: Stopwatch = field(default_factory=Stopwatch)
    oom_snapshot: str = "off"


@dataclass
class Facts:
    """What the start event says that no part holds."""

    resume: Path | None = None
    rank_0: dict | None = None  # several nodes: where rank 0 is
    prec: str = "fp32"
    lr: float = 0.0
    batch_search: dict | None = None  # how data.batch_size = "auto" was chosen
    held: dict[str, Any] | None = None  # activation checkpointing's measurement
    reduce: str = ""  # how gradients are summed


@dataclass
class Built:
    """The parts of a run, built; the trainer calls them."""

    state: TrainState
    model: torch.nn.Module
    opts: Optimizers
    strategy: Strategy
    update: Updater
    hooks: Hooks
    logger: StepLogger
    evaluator: Evaluator
    checkpointer: Checkpointer
    control: ControlHandler
    cadence: Cadence
    nan: NanStop
    profiler: torch_profiler.Profiler
    exchange: Exchange
    compiled: Compiled
    mfu: MFU | None
    eval_loaders: dict
    facts: Facts
    rescue: FailureCheckpoint  # a failure after an update: its state checkpointed
    timeouts: PhaseTimeouts  # start-up's, then the collectives' after the first step
    early_stop: EarlyStop  # train.early_stop_metric: whether the newest eval ended the run
    epochs: EpochClock  # an epoch event at each epoch's end: its wall time


@dataclass
class _Model:
    ctx: TaskContext
    hooks: Hooks
    model: torch.nn.Module
    opts: Optimizers
    strategy: Strategy
    update: Updater
    parts: TaskParts
    train_loader: Any = None
    eval_loaders: dict = field(default_factory=dict)
    mfu: MFU | None = None


@dataclass
class _Start:
    """Where training starts: fresh (step 0), or a checkpoint's."""

    step: int = 0
    evaluated_at: int | None = None
    position: DataPosition = field(default_factory=DataPosition)
    early_stop: dict[str, Any] | None = None  # the checkpoint's count (early_stop.py)


def build(s: Setup) -> Built:
    """Every part, in the order the ranks must build them."""
    facts = Facts(resume=resuming.resume_point(s.run_dir, s.resume, s.restart, s.d, s.out))
    facts.rank_0 = _nodes(s)
    facts.prec = precision.resolve(s.p.train.precision, s.d.device.type, distmod.cuda_capability())
    m = _model(s, facts)
    _data(s, m, facts)
    start = _fresh_or_resumed(s, m, facts, m.strategy.load_before_wrap)
    s.watch.mark("built")
    compiled = _prepare(s, m, facts)
    # The strategy spreads the model over the ranks (FSDP: a sharded checkpoint loads now).
    m.strategy.wrap(m.model, s.task, facts.prec, m.opts, lambda msg: s.out.log("warning", msg))
    autocast = m.strategy.autocast(precision.autocast(facts.prec, s.d.device.type))
    m.update.bind(m.strategy, autocast)
    if facts.resume is not None:
        # A sharded load steps the optimizers once to make their state (torch's DCP
        # _init_optim_state): the engine's step, not the task's (step_watch.py).
        with m.opts.watch.engine():
            back = m.strategy.load_after_wrap(facts.resume, m.model, m.opts, m.update.scalers, s.d)
        if back is not None:
            start = _applied(s, m, facts, back)
    return _loop_parts(s, m, facts, start, compiled, autocast)


def _nodes(s: Setup) -> dict | None:
    """Several nodes: where each one's run directory is. Rank 0's holds the checkpoints;
    every node's console reads the others' telemetry through nodes.json (a shared file
    system). Rank 0's host and run directory, for the start event."""
    d = s.d
    nodes = distmod.nodes_of_run(s.run_dir, d) if d.world_size > d.local_world_size else []
    if nodes and s.out.active:
        with contextlib.suppress(OSError):  # only the other nodes' telemetry depends on it
            write_nodes(s.run_dir, nodes)
    return next(({"host": n["host"], "run_dir": n["run_dir"]} for n in nodes if n["rank"] == 0),
                None)  # fmt: skip


def _model(s: Setup, facts: Facts) -> _Model:
    """The task's context and hooks, its model (the same init on every rank), its
    optimizers, the strategy's scaler and the update step."""
    p, d, task = s.p, s.d, s.task
    resume = facts.resume
    ctx = contexts.make(d, s.run_dir, p, resume is not None, checkpoint.step_of(resume), s.out)
    parts = TaskParts(task, ctx, p.train.seed)  # the contract's order (task_parts.py)
    hooks = Hooks(task, ctx)
    model = parts.model(lambda m: precision.cast_model(m.to(d.device), facts.prec))
    facts.lr = scaled_lr(p.train.lr, d.world_size, p.distributed.lr_scaling)
    strategy = for_profile(p.distributed, d, task, model)
    scaler = strategy.make_scaler(facts.prec, d.device.type, p.train.loss_scale_init)
    # The task's configure_optimizers(), else train.optimizer: every one by name.
    fused_ok = fused_steps_ok(p.distributed.strategy, facts.prec, d.device.type)
    opts = parts.optimizers(
        lambda m: Optimizers.build(task, m, p, d.world_size, d.device.type, ctx, fused_ok)
    )
    if refused := closure_refused(strategy.name, opts):  # every rank the same verdict
        raise Refused(*refused)
    ctx.optimizers = {e.name: e.optimizer for e in opts.entries}  # what the hooks may reach
    update = for_task(task, opts, p.train, d, scaler, ctx, s.beat)
    return _Model(ctx, hooks, model, opts, strategy, update, parts)


def _data(s: Setup, m: _Model, facts: Facts) -> None:
    """The loaders; ``data.batch_size = "auto"``: searched on real steps first, agreed by
    every rank, and recorded in this node's run.toml (a restart or a resume reads it)."""
    p, d, task = s.p, s.d, s.task
    train_set, eval_set = m.parts.datasets()
    if problem := without_compute(task, eval_set, p.task_kind):  # a launch refused it first
        raise Refused("task.kind", problem.removeprefix("task.kind: "))
    cuda = d.device.type == "cuda"
    collate = getattr(task, "collate", None)  # the task's own, else data.collate_of's rule
    if p.data.batch_size == "auto":
        # The search measures the model as it trains: its blocks checkpointed already (the
        # bytes held without and with are then not measured: no micro-batch size yet).
        held = activation_checkpoint.setup(
            task, m.model, p.train.activation_checkpointing, lambda _: None
        )
        if held is not None:
            held["not_measured"] = "data.batch_size = auto: checkpointed before the search"
        facts.held = held
        autocast = precision.autocast(facts.prec, d.device.type)
        data = (train_set, collate)
        facts.batch_search = auto_batch.choose(
            p, task, m.model, m.opts, m.update.step_optimizers, d, autocast, data, m.ctx
        )
        if d.local_rank == 0:
            auto_batch.write_run_toml(s.run_dir, cast(int, p.data.batch_size))  # choose() set it
        s.out.log("info", auto_batch.describe(facts.batch_search))
    m.train_loader = make_loader(
        train_set, p.data, d.rank, d.world_size, True, cuda, collate, prec=facts.prec
    )
    m.eval_loaders = {  # by split (evaluate.py); empty: no eval
        split: make_loader(
            ds,
            p.data,
            d.rank,
            d.world_size,
            False,
            cuda,
            collate,
            p.data.eval_batch_size,
            facts.prec,
        )  # fmt: skip
        for split, ds in eval_splits(eval_set).items()
    }


def _fresh_or_resumed(s: Setup, m: _Model, facts: Facts, load) -> _Start:
    """The per-rank seeds, then the checkpoint's state if ``load`` (the strategy's, before
    wrapping) takes it now."""
    p, d = s.p, s.d
    random.seed(p.train.seed + d.rank)
    torch.manual_seed(p.train.seed + 1_000_003 * (d.rank + 1))  # per-rank dropout streams
    if facts.resume is not None:
        with m.opts.watch.engine():  # a load that steps to make state is the engine's
            back = load(facts.resume, m.model, m.opts, m.update.scalers, d)
        if back is not None:
            return _applied(s, m, facts, back)
    return _Start()


def _applied(s: Setup, m: _Model, facts: Facts, back) -> _Start:
    assert facts.resume is not None  # a checkpoint came back: there was one to load
    start = _Start(*resuming.apply(back, facts.resume, s.d, s.p, s.changes, m.hooks, s.out))
    start.early_stop = back.early_stop
    return start


def _prepare(s: Setup, m: _Model, facts: Facts) -> Compiled:
    """On the bare model: its FLOPs for MFU, activation checkpointing, compile."""
    p, d, task, model = s.p, s.d, s.task, m.model
    autocast = precision.autocast(facts.prec, d.device.type)
    # MFU: FLOPs per sample (the task's count, else measured once on the bare model by the
    # rank that writes events, where MFU can be shown or asked) against the GPUs' peak.
    m.mfu = flops.setup(task, model, m.train_loader, facts.prec, d.world_size, autocast, move,
                        s.out.active, p.train.measure_flops)  # fmt: skip
    # Activation checkpointing wraps the task's blocks in place; measured off and on by the
    # same rank on one micro-batch (activation_checkpoint.py).
    if facts.batch_search is None:
        facts.held = activation_checkpoint.setup(
            task, model, p.train.activation_checkpointing,
            lambda w: activation_checkpoint.held_bytes(
                task, w, move(flops.sample_batch(m.train_loader), d.device), autocast
            ) if s.out.active else None,
        )  # fmt: skip
    # Compiled in place before the strategy wraps it: the names and checkpoints stay.
    compiled = Compiled(mode_of(p.train.compile))
    compiled.apply(model)
    return compiled


def _loop_parts(s: Setup, m: _Model, facts: Facts, start: _Start, compiled, autocast) -> Built:
    """What the loop calls, around the wrapped model."""
    p, d, out = s.p, s.d, s.out
    shared, why_not = m.strategy.gradient_reduce(d, p.distributed, s.run_dir)
    # How gradients are summed: what a CPU run's speed depends on most.
    facts.reduce = "shared memory" if shared else f"{d.backend} ({why_not})"
    exchange = Exchange(d.rank, d.world_size, d.device, shared, precision.table_dtype(facts.prec))
    # The task's train-time metrics ride in the log step's exchange (train_metrics.py).
    metrics = TrainMetrics(s.task, d.rank, d.world_size, d.device, lambda w: out.log("warning", w))
    m.strategy.carry_table(exchange)
    state = TrainState(start.step, Batches(m.train_loader, start.position), start.evaluated_at,
                       start.early_stop)  # fmt: skip
    m.hooks.start(state.step, state.batches)
    control = Control(s.run_dir, d.local_rank == 0, CONTROL_INTERVAL_S, out.unwritable)
    profiler = torch_profiler.Profiler(s.run_dir, d, out)  # the profile command
    saved = Saved(m.model, m.opts, m.update.scalers, m.hooks)
    ckpt = Checkpointer(s.run_dir, p, d, out, s.beat, m.strategy, saved, state, facts.resume)
    if ckpt.best.on and not m.eval_loaders:
        out.log("warning", f"checkpoint.keep_best = {ckpt.best.metric!r}: the task has no eval set")
    early = EarlyStop(p.train, d, state)
    if early.on and not m.eval_loaders:  # every rank the same verdict, before any step
        raise Refused(EARLY_KEY, f"the task has no eval set (got {early.metric!r})")
    evaluator = Evaluator(out, d, s.task, m.model, m.eval_loaders, s.beat, compiled, m.opts,
                          m.hooks, ckpt.best, early)  # fmt: skip
    evaluator.bind(m.strategy, autocast)
    assert m.mfu is not None  # _prepare set it
    memory = MemoryWatch(p.hardware.memory_warn_fraction, lambda w: out.log("warning", w))
    log_parts = LogParts(out, d, p.train, m.opts, exchange, control, m.mfu, s.watch, metrics,
                         compiled, s.beat, memory)  # fmt: skip
    logger = StepLogger(log_parts)
    handler = ControlHandler(out, d, s.beat, control, exchange, profiler, ckpt, logger)
    return Built(
        state, m.model, m.opts, m.strategy, m.update, m.hooks, logger, evaluator, ckpt, handler,
        Cadence(p.train, p.checkpoint, control, bool(m.eval_loaders)),
        NanStop(out, d, p.checkpoint, ckpt, m.model, m.opts),
        profiler, exchange, compiled, m.mfu, m.eval_loaders, facts,
        FailureCheckpoint(d, out, state, ckpt, s.run_dir), PhaseTimeouts(p.distributed, shared),
        early, EpochClock(out, state.batches, state.step),
    )  # fmt: skip
