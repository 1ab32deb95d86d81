"""``data.batch_size = "auto"``: the per-rank batch size, searched on real steps at start.

Every rank runs the same candidates, each on real training steps (forward, backward,
clipping, the optimizers' step, under the run's precision, through the task's ``compute``
or ``train_step``), on the first samples of the training set. After each candidate the
ranks agree on its verdict in one collective (an all-reduce MAX of a failure code and the
step time): one rank's out-of-memory is every rank's, and the slowest rank sets the pace.

The search:

- On GPUs (and wherever ``GPU_CONSOLE_FAKE_OOM_ABOVE`` is set): double from
  :data:`START` until a candidate fails (out of memory, or its peak allocated memory above
  ``1 - data.auto_batch_headroom`` of the GPU's memory, less what other processes hold) or
  reaches the bound (the data set's samples per rank, at most :data:`LARGEST`); then halve
  the gap between the last good and the first bad size (to a multiple of 8 from 64 up).
- On CPU, where nothing runs out of memory: double while samples/s grows; a size is
  taken when its samples/s is at least :data:`GAIN` (10 %) above the best so far, and two
  doublings in a row without that end the search (one alone may be another process's noise).

Afterwards the model's parameters and buffers, the optimizers' and schedules' states,
the task's state (``state_dict``), the context's step and the RNGs are put back as they
were: training then runs exactly as a run given the chosen size directly (the trials use
no GradScaler: see ``Trials._step``). Each node's first rank rewrites its ``run.toml`` with
the number (:func:`write_run_toml`): a restart or ``--resume`` reads it, with no search.

``GPU_CONSOLE_FAKE_OOM_ABOVE`` (tests only): ``N`` makes every candidate above ``N`` raise
``torch.OutOfMemoryError`` on every rank; ``rank1:24`` (comma-separated, one per rank) on
the ranks named only.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ..runs import atomic_write_text
from . import checkpoint
from .data import collate_of, move
from .task_step import StepOptimizers

if TYPE_CHECKING:
    from ..profile import Profile
    from ..tasks.base import Task
    from .context import TaskContext
    from .distributed import Dist
    from .optim_set import Optimizers

FAKE_OOM_ENV = "GPU_CONSOLE_FAKE_OOM_ABOVE"
START = 2  # a batch of one breaks BatchNorm in training
LARGEST = 8192
GAIN = 1.10
PATIENCE = 2  # CPU: doublings in a row without that gain end the search (one may be noise)
TIMED_S = 0.2  # CPU: each candidate's steps are timed over this long at least
COMMENT = '  # chosen by data.batch_size = "auto" (the start event\'s auto_batch says how)'

OK, HEADROOM, OOM, ERROR = 0, 1, 2, 3
VERDICTS = {OK: "ok", HEADROOM: "over headroom", OOM: "out of memory", ERROR: "error"}


class AutoBatchError(RuntimeError):
    """No candidate fits, or a candidate failed with something other than memory."""


@dataclass
class Trial:
    size: int
    code: int  # OK, HEADROOM, OOM, ERROR (the worst over the ranks)
    seconds: float  # a step's time on the slowest rank
    peak: int | None  # the largest peak allocated over the ranks (CUDA), bytes
    samples_per_s: float | None = None  # over all ranks
    verdict: str = ""

    @property
    def ok(self) -> bool:
        return self.code == OK

    def as_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "verdict": self.verdict or VERDICTS[self.code],
            "peak": self.peak,
            "samples_per_s": self.samples_per_s,
        }


def search(trial: Callable[[int], Trial], largest: int, by_memory: bool) -> tuple[int, list]:
    """The chosen size and every trial in the order made (the policy; ``trial`` agrees)."""
    tried: list[Trial] = []

    def run(size: int) -> Trial:
        t = trial(size)
        tried.append(t)
        return t

    size = min(START, largest)
    first, bad = run(size), None
    if not first.ok and size > 1:
        bad, size, first = size, 1, run(1)
    if not first.ok:
        raise AutoBatchError(f"data.batch_size = auto: not even a batch of {size} fits")
    if not by_memory:
        best, misses = first, 0
        while size < largest and bad is None and misses < PATIENCE:
            size = min(size * 2, largest)
            t = run(size)
            if not t.ok:
                break
            if (t.samples_per_s or 0) >= GAIN * (best.samples_per_s or 0):
                best, misses = t, 0
            else:
                t.verdict = f"ok, under {GAIN - 1:.0%} more samples/s"
                misses += 1
        return best.size, tried
    good = size
    while good < largest and bad is None:
        t = run(min(good * 2, largest))
        if not t.ok:
            bad = t.size
            break
        good = t.size
    while bad is not None:
        grain = 8 if good >= 64 else 1
        mid = (good + bad) // 2 // grain * grain
        if mid <= good:
            break
        if run(mid).ok:
            good = mid
        else:
            bad = mid
    return good, tried


def fake_oom_limit(rank: int) -> int | None:
    """The size above which this rank fakes an out-of-memory error (tests only)."""
    raw = os.environ.get(FAKE_OOM_ENV, "").strip()
    if not raw:
        return None
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(?:rank(\d+):)?(\d+)\s*", part)
        if m is None:
            raise ValueError(f"{FAKE_OOM_ENV}: expected N or rankR:N[,...] (got {raw!r})")
        if m.group(1) is None or int(m.group(1)) == rank:
            return int(m.group(2))
    return None


class Snapshot:
    """What a trial step changes, kept on the host and put back exactly."""

    def __init__(self, model: torch.nn.Module, opts, task, ctx, device: torch.device):
        self.model, self.opts, self.task, self.ctx, self.device = model, opts, task, ctx, device
        with torch.no_grad():
            self.tensors = [
                (t, t.detach().to("cpu", copy=True))
                for t in chain(model.parameters(), model.buffers())
            ]
        self.grads = [(q, q.grad) for q in model.parameters()]
        self.optimizers = [copy.deepcopy(e.optimizer.state_dict()) for e in opts.entries]
        self.schedules = [
            copy.deepcopy(e.scheduler.state_dict()) if e.scheduler is not None else None
            for e in opts.entries
        ]
        own = getattr(task, "state_dict", None)
        self.task_state = copy.deepcopy(own()) if callable(own) else None
        self.ctx_step = getattr(ctx, "step", None)
        self.training = model.training
        self.rng = checkpoint.capture_rng(device)

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
        for q, g in self.grads:
            q.grad = g
        for e, state in zip(self.opts.entries, self.optimizers, strict=True):
            e.optimizer.load_state_dict(state)
        for e, state in zip(self.opts.entries, self.schedules, strict=True):
            if state is not None:
                e.scheduler.load_state_dict(state)
        if self.task_state is not None:
            self.task.load_state_dict(self.task_state)
        if self.ctx_step is not None:
            self.ctx.step = self.ctx_step
        self.model.train(self.training)
        checkpoint.restore_rng(self.rng, self.device)


class Trials:
    """Real steps at a candidate size on this rank, and the ranks' one agreement on them."""

    def __init__(
        self,
        p: Profile,
        task: Task,
        model: torch.nn.Module,
        opts: Optimizers,
        owned: StepOptimizers | None,
        d: Dist,
        autocast: contextlib.AbstractContextManager,
        data: tuple[Any, Callable[[Any], Any] | None],
        ctx: TaskContext,
    ):
        dataset, collate = data
        self.task, self.model, self.opts, self.d = task, model, opts, d
        self.ctx = ctx
        self.owned = owned is not None
        self.autocast = autocast
        self.dataset, self.collate = dataset, collate_of(dataset, collate) or default_collate
        self.cuda = d.device.type == "cuda"
        self.fake = fake_oom_limit(d.rank)
        self.limit = _memory_limit(d.device, p.data.auto_batch_headroom) if self.cuda else None
        self.max_norm = p.train.clip_grad_norm if p.train.clip_grad_norm > 0 else math.inf
        # Timed steps, after untimed ones (the optimizers' state, warm caches): on CPU for
        # TIMED_S at least, or a small batch's samples/s is noise.
        self.warm, self.timed_s = (1, 0.0) if self.cuda else (2, TIMED_S)

    def __call__(self, size: int) -> Trial:
        code, seconds, peak, error = self._local(size)
        # The one collective per candidate: the worst verdict, the slowest time, the peak.
        agreed = torch.tensor([code, seconds, peak or 0], dtype=torch.float64, device=self.d.device)
        if self.d.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        code, seconds, peak_all = int(agreed[0].item()), agreed[1].item(), int(agreed[2].item())
        if code == ERROR:
            if error is not None:
                raise error
            raise AutoBatchError(
                f"data.batch_size = auto: another rank failed at batch size {size} "
                "(its log says why)"
            )
        rate = size * self.d.world_size / seconds if code == OK and seconds else None
        return Trial(size, code, seconds, peak_all if self.cuda else None, rate)

    def _local(self, size: int) -> tuple[int, float, int | None, BaseException | None]:
        error: BaseException | None = None
        code, seconds, peak, batch = OK, 0.0, None, None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.d.device)
        try:
            if self.fake is not None and size > self.fake:
                raise torch.OutOfMemoryError(
                    f"{FAKE_OOM_ENV}: batch {size} above {self.fake} (a test's fake)"
                )
            batch = self._batch(size)
            for _ in range(self.warm):
                self._step(batch)  # the optimizers' state is allocated in the first
            self._sync()
            steps, started = 0, time.perf_counter()
            while steps < 1 or time.perf_counter() - started < self.timed_s:
                self._step(batch)
                self._sync()
                steps += 1
            seconds = (time.perf_counter() - started) / steps
        except torch.OutOfMemoryError:
            code = OOM
        except Exception as e:
            code, error = ERROR, e
        if self.cuda and code == OK:
            peak = torch.cuda.max_memory_allocated(self.d.device)
            if self.limit is not None and peak > self.limit:
                code = HEADROOM
        batch = None  # before the cache is emptied
        self.opts.zero_grad()
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()  # the next candidate starts from the same free memory
        return code, seconds, peak, error

    def _batch(self, size: int) -> Any:
        n = len(self.dataset)
        indices = [i % n for i in range(size)]
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return move(self.collate(samples), self.d.device)

    def _step(self, batch: Any) -> None:
        # No GradScaler under fp16: a fresh one's first steps overflow and skip the update,
        # and the optimizers' state (memory a step needs) would never be allocated. The
        # run's scaler is not touched.
        self.model.train()
        if self.owned:
            # One rank's step, no averaging: a rank that fails must not leave the others
            # waiting in a collective.
            step_opts = StepOptimizers(self.opts, self.d.device, 1, 1, self.max_norm, False, None)
            with self.autocast:
                step_opts.run(self.task, self.model, batch, True, self.ctx, 0)
            step_opts.finish()
            return
        with self.autocast:
            result = self.task.compute(self.model, batch)
        result.loss.backward()
        if self.max_norm < math.inf:
            self.opts.clip(self.max_norm)
        self.opts.step(None)
        self.opts.zero_grad()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.d.device)


def _memory_limit(device: torch.device, headroom: float) -> int:
    """Bytes a candidate's peak may reach: the GPU's memory less the headroom and less what
    other processes hold on it."""
    free, total = torch.cuda.mem_get_info(device)
    others = max(0, total - free - torch.cuda.memory_reserved(device))
    return int((1.0 - headroom) * total) - others


def choose(
    p: Profile,
    task: Task,
    model: torch.nn.Module,
    opts: Optimizers,
    owned: StepOptimizers | None,
    d: Dist,
    autocast: contextlib.AbstractContextManager,
    data: tuple[Any, Callable[[Any], Any] | None],
    ctx: TaskContext,
) -> dict:
    """Search, put everything back, set ``p.data.batch_size``; what the start event says.

    ``data``: the training set and the task's collate (or None)."""
    dataset = data[0]
    started = time.perf_counter()
    n = len(dataset)
    largest = min(LARGEST, n // d.world_size)
    if largest < 1:
        raise AutoBatchError(
            f"data.batch_size = auto: {n} samples over {d.world_size} ranks is less than one batch"
        )
    trials = Trials(p, task, model, opts, owned, d, autocast, data, ctx)
    # The same rule on every rank: the variable is every rank's, its limits may not be.
    by_memory = d.device.type == "cuda" or bool(os.environ.get(FAKE_OOM_ENV, "").strip())
    if by_memory:
        trials.timed_s = 0.0  # memory decides: one timed step is enough
    snapshot = Snapshot(model, opts, task, ctx, d.device)
    try:
        chosen, tried = search(trials, largest, by_memory)
    finally:
        snapshot.restore()
        del snapshot
        if d.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d.device)
    p.data.batch_size = chosen
    return {
        "chosen": chosen,
        "rule": "memory" if by_memory else "throughput",
        "headroom": p.data.auto_batch_headroom if by_memory else None,
        "limit": trials.limit,
        "largest": largest,
        "tried": [t.as_dict() for t in tried],
        "seconds": round(time.perf_counter() - started, 3),
    }


def describe(report: dict) -> str:
    """The log line: the size chosen, by which rule, and what was tried."""
    tried = ", ".join(
        f"{t['size']} {'ok' if t['verdict'] == 'ok' else t['verdict']}" for t in report["tried"]
    )
    rule = (
        f"the largest that fits with {report['headroom']:.0%} of memory free"
        if report["rule"] == "memory"
        else f"where samples/s stopped growing by {GAIN - 1:.0%}"
    )
    return (
        f"data.batch_size = auto: {report['chosen']} per rank per micro-batch ({rule}; "
        f"tried {tried}; {report['seconds']:.1f} s)"
    )


def write_run_toml(run_dir: Path, chosen: int) -> None:
    """Replace ``batch_size = "auto"`` in run.toml's ``[data]`` with the number, a comment
    saying it was chosen; written atomically (a reader never sees half a file)."""
    path = Path(run_dir) / "run.toml"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    section = None
    for i, line in enumerate(lines):
        head = re.fullmatch(r"\s*\[([^\]]+)\]\s*", line)
        if head:
            section = head.group(1).strip()
        elif section == "data" and re.fullmatch(r'\s*batch_size\s*=\s*"auto"\s*', line):
            lines[i] = f"batch_size = {chosen}{COMMENT}\n"
            break
    else:
        return  # already a number (a restart read it)
    atomic_write_text(path, "".join(lines))
