"""The eval pass: every rank's eval batches, metrics averaged over all ranks' samples.

A task's ``build_datasets`` may return several eval sets by split (``{"val": ...,
"train_est": ...}``): each is evaluated in turn, its metrics named ``<split>/<metric>``
(``val/loss``; ``checkpoint.keep_best = "eval.val/loss"``), in one ``eval`` event.

Progress: rank 0 says where the pass is (``progress`` events, ``phase = "eval"``,
``done``/``total`` batches of rank 0's shard) at its first batch and then about once a second,
so a reader shows ``eval 120/400`` and never takes a long eval for a stall (fold.py counts an
eval batch as a sign of life like a step). Every rank's heartbeat says ``eval`` and its batch
(``detail``: ``120/400``), since that batch began.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .data import move
from .failure_checkpoint import naming

if TYPE_CHECKING:
    from ..tasks.base import Task
    from .best import Best
    from .compile import Compiled
    from .distributed import Dist
    from .early_stop import EarlyStop
    from .heartbeat import Beat
    from .hooks import Hooks
    from .optim_set import Optimizers
    from .reporter import Reporter
    from .strategy import Strategy
    from .train_state import TrainState

# data.move's shape: a batch onto the rank's device.
Move = Callable[[Any, torch.device], Any]

PROGRESS_EVERY_S = 1.0


def splits(eval_set) -> dict[str, Any]:
    """The task's eval sets by split: a dict it returned (``{"val": ..., "train_est": ...}``),
    or its one set under ``""`` (its metrics keep their bare names); none: empty."""
    if eval_set is None:
        return {}
    if isinstance(eval_set, dict):
        return {str(k): v for k, v in eval_set.items() if v is not None}
    return {"": eval_set}


def without_compute(task, eval_set, kind: str) -> str | None:
    """The one-line refusal of eval data for a task without ``compute`` (its ``train_step``
    trains; eval runs ``compute`` on each batch), else None."""
    if hasattr(task, "compute") or not splits(eval_set):
        return None
    return (
        f"task.kind: {kind} returns eval data from build_datasets() but has no "
        "compute(model, batch), which eval runs on each batch: add compute, or return None "
        f"as the eval set (got {kind!r})"
    )


def metric_name(split: str, name: str) -> str:
    """``val/loss`` for a named split's metric (``eval.val/loss`` for keep_best), else ``loss``."""
    return f"{split}/{name}" if split else name


def evaluate(
    out: Reporter,
    d: Dist,
    task: Task,
    wrapped: Any,
    loaders: dict[str, DataLoader],
    autocast: contextlib.AbstractContextManager,
    step: int,
    move: Move,
    beat: Beat,
) -> dict[str, float]:
    """Collective: every split's metrics, averaged over every rank's eval (on every rank):
    the ``eval`` event's numbers (:meth:`Evaluator.run` writes it)."""
    metrics: dict[str, float] = {}
    derived = getattr(task, "derived_metrics", None) or {}
    for split, loader in loaders.items():
        with naming(f"eval '{split}'" if split else "eval"):  # a task's collate, compute
            got = _evaluate_split(out, d, task, wrapped, loader, autocast, step, move, beat,
                                  split)  # fmt: skip
        for name, derive in derived.items():
            got[name] = float(derive(dict(got)))
        metrics.update((metric_name(split, k), v) for k, v in got.items())
    return metrics


@torch.no_grad()
def _evaluate_split(
    out: Reporter,
    d: Dist,
    task: Task,
    wrapped: Any,
    loader: DataLoader,
    autocast: contextlib.AbstractContextManager,
    step: int,
    move: Move,
    beat: Beat,
    split: str,
) -> dict[str, float]:
    """One split's metrics, averaged over every rank's samples (collective).

    Each batch's ``loss`` and metrics are weighted by its ``tokens`` where the task counts
    them (a per-token loss then averages as total loss over total tokens), else by its
    ``samples``: a short last batch counts for what it holds (a mean of per-batch means would
    not). The task's ``derived_metrics`` (name: function of the averaged metrics), e.g.
    ``perplexity = exp(loss)``, are added by :func:`evaluate`.
    """
    wrapped.eval()
    totals: dict[str, float] = {}
    weight = 0  # tokens, else samples
    total = len(loader)
    said = 0.0
    where = {"split": split} if split else {}
    extra = _shortfall(d, total) if getattr(wrapped, "same_forwards", False) else 0
    for i, batch in enumerate(loader):
        # A stuck eval names its batch, and for how long.
        beat.set(step, "eval", f"{split + ' ' if split else ''}{i}/{total}")
        now = time.monotonic()
        if out.active and now - said >= PROGRESS_EVERY_S:
            out.event("progress", phase="eval", step=step, done=i, total=total, **where)
            said = now
        batch = move(batch, d.device)
        with autocast:
            result = task.compute(wrapped.module, batch)
        n = result.tokens or result.samples
        weight += n
        totals["loss"] = totals.get("loss", 0.0) + float(result.loss) * n
        for name, value in result.metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
    if extra:
        _pad(d, task, wrapped, loader, autocast, move, extra)
    wrapped.train()
    # A rank with no eval batch (fewer samples than ranks) knows no metric names: agree on
    # them first, so every rank's buffer has the same shape. Eval is rare; this is cheap.
    every: list[list[str] | None] = [None] * d.world_size
    dist.all_gather_object(every, sorted(totals))
    names = sorted({n for ranks_names in every for n in ranks_names or []})
    values = [totals.get(k, 0.0) for k in names] + [weight]
    buf = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(buf)
    values = buf.tolist()
    weights = max(values[-1], 1)  # every rank's, summed
    return {k: v / weights for k, v in zip(names, values[:-1], strict=True)}


def _shortfall(d: Dist, batches: int) -> int:
    """FSDP: every forward all-gathers, so every rank runs as many as the rank with the most
    eval batches (a split's samples need not divide by the ranks): how many this one lacks.
    Agreed before the first batch, while no rank is in a forward."""
    most = torch.tensor([batches], dtype=torch.int64, device=d.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - batches


def _pad(
    d: Dist,
    task: Task,
    wrapped: Any,
    loader: DataLoader,
    autocast: contextlib.AbstractContextManager,
    move: Move,
    extra: int,
) -> None:
    """The forwards this rank lacks (:func:`_shortfall`), on a batch read from the dataset
    directly, their results dropped."""
    from .flops import sample_batch

    batch = move(sample_batch(loader), d.device)
    for _ in range(extra):
        with autocast:
            task.compute(wrapped.module, batch)


def at_start(enabled: bool, step: int, evaluated_at: int | None, changes: list[dict]) -> bool:
    """``train.eval_at_start``: the run's eval at step 0, before any update.

    It belongs to the run, not to a session: a plain resume does not evaluate at the step it
    resumes from, since the uninterrupted run did not evaluate there (an eval may draw from
    the task's own streams and fires ``on_eval_end``: the resume would not be exact). Only a
    resume that turns it on (``--set train.eval_at_start=true``, one of its ``changes``)
    evaluates there, an ask for an eval now, unless the run already evaluated at that step
    (``evaluated_at``, saved in the checkpoint).
    """
    if not enabled or evaluated_at == step:
        return False
    return step == 0 or any(c.get("key") == "train.eval_at_start" for c in changes)


class Evaluator:
    """The run's evals: at their steps, their metrics to the schedules, the task's hook, the
    best checkpoint's judge and early stopping's."""

    def __init__(
        self,
        out: Reporter,
        d: Dist,
        task: Task,
        model: torch.nn.Module,
        loaders: dict[str, DataLoader],
        beat: Beat,
        compiled: Compiled,
        opts: Optimizers,
        hooks: Hooks,
        best: Best,
        early_stop: EarlyStop,
    ) -> None:
        self.out, self.d, self.task, self.loaders, self.beat = out, d, task, loaders, beat
        self.model = model  # the bare model, for the task's eval_end hook
        self.compiled, self.opts, self.hooks, self.best = compiled, opts, hooks, best
        self.early_stop = early_stop
        self.strategy: Any = None
        self.autocast: Any = None

    def bind(self, strategy: Strategy, autocast: contextlib.AbstractContextManager) -> None:
        """What an eval runs: the strategy's wrapped model, under the step's autocast."""
        self.strategy, self.autocast = strategy, autocast

    def run(self, state: TrainState) -> bool:
        """Collective: one eval at ``state.step``; whether its metric improved on the best."""
        step = state.step
        state.evaluated_at = step
        self.beat.set(step, "eval")
        wrapped = self.strategy.wrapped
        self.hooks.eval_start(self.model)
        with self.compiled.eager():
            metrics = evaluate(
                self.out, self.d, self.task, wrapped, self.loaders, self.autocast, step, move,
                self.beat,
            )  # fmt: skip
        self.opts.after_eval(metrics)  # a plateau schedule: on the eval's own metrics
        with naming("the task's on_eval_end hook"):
            metrics.update(self.hooks.eval_end(self.model, metrics))  # its own figures
        if self.out.active:
            self.out.event("eval", step=step, **metrics)
        # train.early_stop_metric: judged on every rank, agreed (the trainer ends the run).
        counted = self.early_stop.observe(step, metrics)
        if counted is not None and self.out.active:
            self.out.event("early_stop", **counted)
        return self.best.observe(step, metrics, lambda m: self.out.log("warning", m))
