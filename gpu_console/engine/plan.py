"""``python -m gpu_console.engine.plan``: what a run would build, for ``run --dry-run``.

The console never imports torch, so it asks this subprocess. It reads ``{"profile": ...,
"device_type": ..., "world_size": ...}`` (the resolved profile as run.toml would hold it) on
stdin, builds the task's model, datasets, optimizer and schedule once on the CPU with the
engine's own builders (the ones build.py calls), then (unless ``"step": false``, ``--no-step``)
rehearses one real training micro-batch and one batch of each eval split (:func:`rehearse`),
and prints one JSON line: ``{"plan": {...}}``, or ``{"error": "..."}`` naming the task, where
it failed and its exception's last line. Nothing is written.

A launch asks it too, for a user task (``"only": "data", "check": true``; the document on
one line): first the task's keys (``tasks/check.py``'s answer, on a line of its own); then,
if they hold and once the launch's other checks have passed (a ``go`` line on stdin, with
the profile as they left it), its data sets counted (``{"data": {"train_samples": N}}``):
one torch start-up before a launch, not two.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..batching import IN_EPOCHS, batch_problem, epochs_to_steps
from ..devices import fused_steps_ok
from ..profile import Profile, resolve, with_task_config
from ..schema import show
from ..tasks.check import check as check_task
from ..tasks.loader import TaskLoadError, load_task_class
from . import activation_checkpoint, fsdp, precision, train_metrics
from .compile import mode_of
from .context import planning
from .data import make_loader
from .evaluate import splits as eval_splits
from .evaluate import without_compute
from .optim_set import Optimizers
from .schedule import decay_steps, floor_ratio, lr_factor, scaled_lr
from .strategy import choose, closure_refused
from .strategy_expert import ExpertParallelError
from .task_parts import TaskParts
from .task_step import StepOptimizers

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from .context import TaskContext

SOURCE = "the resolved profile"


class TaskBuildError(Exception):
    """The task failed to import or build: a user's own code raised."""


def _last_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _call(kind: str, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        raise TaskBuildError(f"task {kind}: {what} failed: {_last_line(e)}") from e


def capability(device_type: str) -> tuple[int, int] | None:
    """The first granted GPU's compute capability (the console's mask makes it device 0)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(0)
    return None


def _task(p: Profile) -> tuple[Profile, Any]:
    """The profile with its task's typed config, and the task constructed from it."""
    kind = p.task_kind
    try:
        task_cls = load_task_class(kind)
    except TaskLoadError as e:
        raise TaskBuildError(f"task {kind}: {e}") from None
    p = with_task_config(p, task_cls.Config, SOURCE)
    return p, _call(kind, "its constructor", task_cls, p.task)


def plan(
    p: Profile,
    device_type: str,
    world_size: int,
    start_step: int = 0,
    step: bool = True,
    scratch: str | None = None,
) -> dict[str, Any]:
    """The facts a run would start from, built as build.py builds them (model on the CPU);
    ``step``: then one real micro-batch and one batch of each eval split (:func:`rehearse`)."""
    kind = p.task_kind
    p, task = _task(p)
    with planning(p, world_size, device_type, scratch) as ctx:
        ctx.resumed, ctx.start_step, ctx.step = bool(start_step), start_step, start_step
        parts = TaskParts(task, ctx, p.train.seed, _caller(kind))  # the ranks' order (build.py)
        reduce = _call(kind, "metric_reduce", train_metrics.declared, task)  # checked at start too
        prec = precision.resolve(p.train.precision, device_type, capability(device_type))

        model = parts.model()
        lr = scaled_lr(p.train.lr, world_size, p.distributed.lr_scaling)
        # The optimizers are built for the run's device type (their kernel choice), over CPU
        # tensors: every implementation a run can pick takes them. A task's hook sees rank 0.
        opts = parts.optimizers(_optimizers(p, task, ctx, prec, device_type, world_size))
        scheduler = opts.entries[0].scheduler

        mode = p.train.activation_checkpointing
        blocks = _checkpointed_blocks(task, model, mode, kind)
        train_set, eval_set = datasets(p, parts, kind, world_size)
        if any(getattr(p.train, k) for k in IN_EPOCHS):  # a user task's --dry-run: known only here
            epochs_to_steps(p, len(train_set), world_size, _refusal)
        # Rank 0's loader: every rank's has the same number of batches (ShardSampler). With
        # data.batch_size = "auto" the size is searched at the run's start: not known here.
        auto = p.data.batch_size == "auto"
        cuda = device_type == "cuda"
        loader = None if auto else make_loader(train_set, p.data, 0, world_size, True, cuda)
        per_epoch = len(loader) if loader is not None else None
        micro_steps = p.train.max_steps * p.train.grad_accum
        facts = {
            "task": kind,
            "task_class": f"{type(task).__module__}:{type(task).__qualname__}",
            "precision": prec,
            "capability": list(capability(device_type) or []) or None,
            "params": sum(q.numel() for q in model.parameters()),
            "trainable": sum(q.numel() for q in model.parameters() if q.requires_grad),
            "train_samples": len(train_set),
            "eval_samples": sum(len(s) for s in eval_splits(eval_set).values())
            if eval_set
            else None,
            "batches_per_epoch": per_epoch,
            "epochs": micro_steps / per_epoch if per_epoch and micro_steps else None,
            "global_batch": None if auto else p.data.batch_size * p.train.grad_accum * world_size,
            "lr": lr,
            "optimizer": opts.summary(),
            "optimizers": opts.describe(),  # as the start event has them
            "metric_reduce": reduce,  # the task's train-time metrics' declared reductions
            "weight_decay": opts.decay.fields() if opts.decay else None,
            # The first optimizer's groups; each one's lr is the peak.
            "param_groups": opts.describe()[0]["param_groups"],
            # The profile's schedule; a task's own are in "optimizers".
            "schedule": None if opts.source == "task" else _schedule(p, lr, start_step, scheduler),
            "compile": mode_of(p.train.compile) or False,
            "activation_checkpointing": {"mode": mode, "blocks": blocks},
            "versions": {"torch": torch.__version__},
            "strategy": _strategy(p, task, model, kind, device_type, world_size),
        }
        if refused := closure_refused(facts["strategy"]["strategy"], opts):  # as the ranks would
            raise TaskBuildError(": ".join(refused))
        # Last: the micro-batch's update must not change what the plan reports.
        facts["rehearsal"] = (
            rehearse(p, task, kind, model, opts, (train_set, eval_set), ctx) if step else None
        )
        return facts


def rehearse(
    p: Profile,
    task: Any,
    kind: str,
    model: torch.nn.Module,
    opts: Optimizers,
    data: tuple[Any, Any],
    ctx: TaskContext,
) -> dict[str, Any]:
    """One real training micro-batch and one batch of each eval split, on the CPU, through
    the task's collate and compute (or train_step), so that a bug there (an eval collate
    that breaks, a key missing) fails in seconds, naming where, before any launch."""
    train_set, eval_set = data
    started = time.perf_counter()
    _one_rank_group()
    size = p.data.batch_size if isinstance(p.data.batch_size, int) else 1  # "auto": 1
    cfg = replace(p.data, batch_size=size, num_workers=0, persistent_workers=False)
    collate = getattr(task, "collate", None)  # as build.py hands it to the loaders
    loader = make_loader(train_set, cfg, 0, 1, True, False, collate)
    batch = _call(kind, "a training batch", lambda: next(iter(loader)))
    model.train()
    if hasattr(task, "train_step"):
        steps = StepOptimizers(opts, torch.device("cpu"), 1, 1, math.inf, False, None)
        _call(kind, "train_step()", steps.run, task, model, batch, True, ctx, 0)
    else:
        out = _call(kind, "compute()", task.compute, model, batch)
        _call(kind, "the backward of compute()'s loss", out.loss.backward)
    evaluated = []
    model.eval()
    for split, ds in eval_splits(eval_set).items():
        what = f"eval '{split}'" if split else "eval"
        ev = make_loader(ds, cfg, 0, 1, False, False, collate, p.data.eval_batch_size)
        if len(ev):
            with torch.no_grad():
                _call(kind, what, lambda ev=ev: task.compute(model, next(iter(ev))))
            evaluated.append(split)
    model.train()
    return {"eval_splits": evaluated, "seconds": time.perf_counter() - started}


def _one_rank_group() -> None:
    """A process group of this one process (gloo, an in-memory store, nothing on the network):
    a task's train_step or compute may call collectives, which then see rank 0's data alone."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _checkpointed_blocks(task: object, model: torch.nn.Module, mode: str, kind: str) -> int:
    """The blocks activation checkpointing would wrap (the task's blocks())."""
    if mode == "none":
        return 0
    try:
        return len(activation_checkpoint.blocks_of(task, model))
    except activation_checkpoint.NoBlocks as e:
        raise TaskBuildError(f"task {kind}: {e}") from None


def _schedule(p: Profile, lr: float, start_step: int, scheduler: LRScheduler) -> dict[str, Any]:
    """The profile's schedule, as the run would follow it."""
    # Until stopped (max_steps = 0): last_lr is the lr from the decay's end on.
    last = p.train.max_steps or max(1, p.train.warmup_steps + decay_steps(p.train))
    return {
        "kind": p.train.schedule,
        "warmup_steps": p.train.warmup_steps,
        "min_lr_ratio": floor_ratio(p.train),
        "decay_end": p.train.warmup_steps + decay_steps(p.train),
        "max_steps": p.train.max_steps,
        "start_step": start_step,
        # The lr of the first update this run makes (a resumed one: after start_step).
        "first_lr": lr * lr_factor(start_step, p.train)
        if start_step
        else scheduler.get_last_lr()[0],
        "last_lr": lr * lr_factor(last - 1, p.train),
    }


def _refusal(key: str, problem: str, value: Any) -> TaskBuildError:
    return TaskBuildError(f"{key}: {problem} (got {show(value)})")


def _caller(kind: str):
    """How :class:`TaskParts` calls the task here: a failure in one line naming the call."""
    return lambda what, fn, *args: _call(kind, what, fn, *args)


def _optimizers(p: Profile, task, ctx, prec: str, device_type: str, world_size: int):
    """The optimizers as build.py makes them (``Optimizers.build``), for a model."""
    fused_ok = fused_steps_ok(p.distributed.strategy, prec, device_type)
    return lambda model: Optimizers.build(task, model, p, world_size, device_type, ctx, fused_ok)


def datasets(p: Profile, parts: TaskParts, kind: str, world_size: int) -> tuple[Any, Any]:
    """The task's data sets (after its model and optimizers: task_parts.py), the training set
    checked against the batch (batching.py): the check a launch makes too (:func:`data_size`,
    judged by ``launch.check_data``)."""
    train_set, eval_set = parts.datasets()
    if problem := batch_problem(len(train_set), world_size, p.data.batch_size, p.data.drop_last):
        raise TaskBuildError(f"data.batch_size: {problem} (got {show(p.data.batch_size)})")
    if problem := without_compute(parts.task, eval_set, kind):
        raise TaskBuildError(problem)
    return train_set, eval_set


def data_size(
    p: Profile, device_type: str, world_size: int, scratch: str | None = None
) -> dict[str, Any]:
    """A launch's half of :func:`plan`: the task's data sets counted, made as the ranks make
    them (task_parts.py: the model and its optimizers first, a ``build_datasets`` may use
    what ``build_model`` set). The model is built on the meta device where the task allows
    it (no weights allocated for a check), else on the CPU, as a resume's model check does."""
    kind = p.task_kind
    p, task = _task(p)
    with planning(p, world_size, device_type, scratch) as ctx:
        prec = precision.resolve(p.train.precision, device_type, capability(device_type))
        build = _optimizers(p, task, ctx, prec, device_type, world_size)
        train_set, eval_set = _counted(task, ctx, p.train.seed, kind, build)
        if problem := without_compute(task, eval_set, kind):
            raise TaskBuildError(problem)
        return {"train_samples": len(train_set)}  # the console judges it (launch.check_data)


def _counted(task, ctx, seed: int, kind: str, build) -> tuple[Any, Any]:
    """The data sets, after the model and its optimizers made on the meta device; a task
    whose build_model, optimizers or data sets need real weights (a weight loaded, a value
    read) is made again on the CPU, from its seed."""
    try:
        return _made(TaskParts(task, ctx, seed, _caller(kind)), build, "meta")
    except TaskBuildError:
        return _made(TaskParts(task, ctx, seed, _caller(kind)), build, None)


def _made(parts: TaskParts, build, device: str | None) -> tuple[Any, Any]:
    """The data sets, after the model (on ``device``) and its optimizers."""
    parts.model(device=device)
    parts.optimizers(build)
    return parts.datasets()


def _strategy(
    p: Profile, task: object, model: torch.nn.Module, kind: str, device_type: str, world: int
) -> dict:
    """The strategy the ranks will pick (strategy.choose, the ranks' own choice) and, under
    fsdp, what would be sharded (fsdp.py)."""
    d = p.distributed
    try:
        name, experts = choose(d, world, task, model)
    except ExpertParallelError as e:  # the profile's keys conflict: not the task's failure
        raise TaskBuildError(str(e)) from None
    except Exception as e:  # the task's expert_parameters() raised
        raise TaskBuildError(f"task {kind}: expert_parameters() failed: {_last_line(e)}") from e
    if name != "fsdp":
        fields: dict[str, Any] = {"strategy": name}
        if experts:
            fields["expert_parallel"] = {"parameters": len(experts)}  # as the start event
        return fields
    blocks = _call(kind, "blocks()", fsdp.blocks_of, task, model)
    on_gpu = device_type == "cuda"  # CPU ranks ignore the offload, saying so (fsdp.py)
    return {
        "strategy": "fsdp",
        "fsdp": {
            "sharded_blocks": len(blocks),
            "root_only": not blocks,
            "reshard_after_forward": d.fsdp_reshard_after_forward,
            "cpu_offload": d.fsdp_cpu_offload and on_gpu,
        },
    }


def _say(answer: dict, tag: str | None) -> None:
    """One line for the console, with the tag it sent: a line the task prints itself is
    never taken for it (dry_run.py)."""
    print(json.dumps({**answer, "tag": tag}), flush=True)


def main() -> int:
    from ..held_signals import release

    release()  # the launch holds the scheduler's signals; a plan is ended by them as usual
    doc = json.loads(sys.stdin.readline())  # one line (JSON escapes its newlines)
    own = None
    if not doc.get("scratch"):  # run by hand, not by the console: a directory of its own
        own = tempfile.TemporaryDirectory(prefix="gpu-console-plan-")
        doc["scratch"] = own.name
    try:
        return _main(doc, doc.get("tag"))
    finally:
        if own is not None:
            own.cleanup()


def _main(doc: dict, tag: str | None) -> int:
    if doc.get("check"):  # a launch's task check first, then its data (dry_run.TaskProcess)
        table = dict(doc["profile"]["task"])
        kind = table.pop("kind")
        verdict = check_task(kind, table)
        _say({"check": verdict}, tag)
        if verdict["errors"]:
            return 0
        # The data sets are built once the launch's other checks have passed: its "go"
        # brings the profile as they left it (the task's keys resolved).
        try:
            go = json.loads(sys.stdin.readline())
        except ValueError:
            return 0  # ended: the launch was refused
        if not isinstance(go, dict) or not go.get("go"):
            return 0
        doc["profile"] = go["profile"]
    answer: dict[str, Any]
    try:
        p = resolve(doc["profile"], SOURCE)
        world, start = int(doc["world_size"]), int(doc.get("start_step") or 0)
        scratch = doc["scratch"]  # the console's temporary directory (dry_run.py)
        if doc.get("only") == "data":  # a launch's check (launch.check_data)
            answer = {"data": data_size(p, doc["device_type"], world, scratch)}
        else:
            step = bool(doc.get("step", True))  # --dry-run --no-step: the build only
            answer = {"plan": plan(p, doc["device_type"], world, start, step, scratch)}
    except TaskBuildError as e:
        answer = {"error": str(e)}
    except Exception as e:  # a profile key the task's data cannot meet (batch_size, ...)
        answer = {"error": f"task {doc['profile']['task'].get('kind')}: {_last_line(e)}"}
    _say(answer, tag)
    return 0


if __name__ == "__main__":
    code = main()
    # The answer is out: no wait for what the task started and left running (a non-daemon
    # process or thread), which the console ends with this process group.
    sys.stderr.flush()
    os._exit(code)
