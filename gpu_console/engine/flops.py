"""Model FLOPs per training sample, for MFU: the task's own count, else measured once.

A task may declare ``flops_per_sample()`` (training FLOPs of one sample: forward and
backward; the built-in tasks count theirs from their shapes). Otherwise, where MFU can be
shown (a GPU in the peak table) or ``train.measure_flops = true`` asks, the writing rank
measures them before training: one forward and backward of a batch under
``torch.utils.flop_counter.FlopCounterMode``, on the bare model (before DDP). The
measurement leaves no trace: the RNG streams are forked, buffers (BatchNorm statistics) are
put back, gradients are dropped, and the batch is read from the dataset directly, not from
the training loader, so data order and the loader's generator are untouched. The task's
``compute`` does run once more than the training steps (a task that counts its calls sees
it).

FlopCounterMode counts matmuls, convolutions and attention (not elementwise work), as the
built-in counts do. On CPU, where attention runs a kernel FlopCounterMode has no formula
for, its formula for the CUDA kernels is used.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from ..peaks import Peak, UnknownPeak, matmul_precision, mfu, peak_for
from ..tasks.base import HasState

if TYPE_CHECKING:
    from ..tasks.base import Task


@contextlib.contextmanager
def _counting() -> Any:
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    extra: dict[Any, Any] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and hasattr(fc, "sdpa_flop_count"):
        extra[fwd] = lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v)
    if bwd is not None and hasattr(fc, "sdpa_backward_flop_count"):
        extra[bwd] = lambda g, q, k, v, *a, out_shape=None, **kw: fc.sdpa_backward_flop_count(
            g, q, k, v
        )
    counter = FlopCounterMode(display=False, custom_mapping=extra)
    with counter:
        yield counter


class _NotHere(Exception):
    """This rank does not measure (another one does, for the events)."""


class _NotAsked(Exception):
    """``train.measure_flops`` says not to measure here."""


class _NoCompute(Exception):
    """A task that trains through its ``train_step`` alone: no ``compute`` to measure."""


def sample_batch(loader: DataLoader) -> Any:
    """A training batch read from the loader's dataset directly (the loader is untouched)."""
    ds = loader.dataset
    size = loader.batch_size or int(getattr(loader.batch_sampler, "batch_size", 1))
    n = min(size, len(cast(Sized, ds)))  # a training set has a length (data.py checks it)
    indices = list(range(n))
    getitems = getattr(ds, "__getitems__", None)
    items = getitems(indices) if getitems else [ds[i] for i in indices]
    return loader.collate_fn(items) if loader.collate_fn else items


def measure(
    task: Task, model: torch.nn.Module, batch: Any, autocast: contextlib.AbstractContextManager
) -> float:
    """Training FLOPs per sample of ``task.compute`` on ``batch`` (forward and backward)."""
    device = next(model.parameters()).device
    kept = {name: b.detach().clone() for name, b in model.named_buffers()}
    # A stateful task (an RNN's carried hidden state) changes its state in compute: the
    # measured call must leave no trace, also after a resume gave the state back.
    task_state = _task_state(task)
    forked = [device] if device.type == "cuda" else []
    try:
        rng = torch.random.fork_rng(devices=forked, device_type=device.type)
        with rng, _counting() as counter:
            with autocast:
                result = task.compute(model, batch)
            result.loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(kept[name])
        if task_state is not None:
            cast(HasState, task).load_state_dict(task_state)  # it has one: it gave its state
    return counter.get_total_flops() / max(int(result.samples), 1)


def _task_state(task: object) -> Any:
    """A copy of the task's own state (its ``state_dict``), or None where it has none."""
    if getattr(task, "state_dict", None) is None or getattr(task, "load_state_dict", None) is None:
        return None
    return copy.deepcopy(cast(HasState, task).state_dict())


def per_sample(task: object, measure_now: Callable[[], float]) -> tuple[float | None, str]:
    """(FLOPs per sample, where they come from): ``task`` (declared) or ``measured``.

    ``(None, why)`` when neither gives a number.
    """
    declared = getattr(task, "flops_per_sample", None)
    if callable(declared):
        value = declared()
        if value:
            return float(value), "task"
    try:
        value = measure_now()
    except _NotHere:
        return None, "measured by the rank that writes events"
    except _NotAsked:
        return None, "FLOPs not measured (train.measure_flops = false)"
    except _NoCompute:
        return None, "the task has no compute() to measure (declare flops_per_sample)"
    except Exception as e:  # a task the counter cannot follow is no reason to fail the run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, f"could not measure FLOPs: {type(e).__name__}: {e}"[:300]
    return (value, "measured") if value > 0 else (None, "no matmul FLOPs measured")


class MFU:
    """What MFU needs, decided once before training: FLOPs per sample and the GPUs' peak."""

    def __init__(
        self, flops: float | None, flops_from: str, peak: Peak | None, world: int, why: str | None
    ):
        self.flops, self.flops_from, self.peak = flops, flops_from, peak
        self.peak_total = peak.flops * world if peak else None
        self.why_not = why  # why MFU is not shown (None when it is)

    def of(self, samples_per_s: float) -> float | None:
        return mfu(self.flops, samples_per_s, self.peak_total)

    def start_fields(self) -> dict[str, Any]:
        return {
            "flops_per_sample": self.flops,
            "flops_from": self.flops_from,
            "peak_flops": self.peak.flops if self.peak else None,
            "peak": self.peak.describe() if self.peak else None,
            "mfu_not_shown": self.why_not,
        }


def setup(
    task,
    model,
    loader: DataLoader,
    precision: str,
    world: int,
    autocast,
    move,
    writer: bool,
    asked: bool | str = "auto",
) -> MFU:
    """Count the FLOPs (or measure them, on the rank that writes events: ``writer``) and
    look up the peak of this rank's device. ``asked`` is ``train.measure_flops``: ``auto``
    measures only where MFU can be shown (a GPU in the peak table), so a CPU run or an
    unknown GPU runs no extra forward and backward before its first step."""
    device = next(model.parameters()).device
    peak, why = _peak(device, precision)
    wanted = asked is True or (asked == "auto" and peak is not None)

    def measure_now() -> float:
        if not wanted:
            raise _NotAsked
        if not writer:
            raise _NotHere
        if not hasattr(task, "compute"):
            raise _NoCompute
        return measure(task, model, move(sample_batch(loader), device), autocast)

    flops, flops_from = per_sample(task, measure_now)
    if flops is None:
        # The device's reason first: with it, the FLOPs would not have given an MFU anyway.
        why = why or f"{flops_from}: MFU not shown"
        flops_from = "not measured" if not wanted else "unknown"
    return MFU(flops, flops_from, peak, world, why)


def _peak(device: torch.device, precision: str) -> tuple[Peak | None, str | None]:
    """(this device's dense peak, None) or (None, why MFU is not shown)."""
    if device.type != "cuda":
        return None, f"{device.type.upper()} run (the peak table covers NVIDIA GPUs): MFU not shown"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        return peak_for(torch.cuda.get_device_name(device), matmul_precision(precision, tf32)), None
    except UnknownPeak as e:
        return None, str(e)
