"""``train.activation_checkpointing``: recompute activations in the backward to save memory.

- ``blocks``: each of the task's blocks runs under non-reentrant ``torch.utils.checkpoint``:
  only a block's input is kept for the backward, the rest is recomputed there.
- ``selective``: the same wrapping with PyTorch's selective activation checkpointing
  (``create_selective_checkpoint_contexts``): matmul and attention outputs are kept (the
  expensive ops), the cheap ones (norms, activations, dropout) recomputed, as torchtitan's
  op-level policy does.

The task names its blocks with ``blocks(model) -> list[nn.Module]`` (the built-in
transformer: its encoder blocks). Each block's ``forward`` is wrapped in place, so parameter
names, ``state_dict`` keys, checkpoints and ``export`` are the same with and without. The RNG
state is replayed in the recomputation (dropout draws the same masks): losses are the same.
A block's BatchNorm running statistics are put back as the forward left them once its
recomputation is done (a second forward would update them twice): buffers, evals and
checkpoints are the same too.

Memory, measured: before training, the rank that writes events runs one forward of one
micro-batch with checkpointing off, then on, and counts the bytes of the tensors that forward
leaves alive for the backward (activations; parameters and the batch not counted), through a
dispatch mode that follows every tensor the forward creates. Device-independent: the same
figure on CPU and GPU. Like the FLOPs probe (flops.py), it leaves no trace: RNG forked,
buffers put back, no gradient kept, the batch read from the data set, not the loader.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from . import torch_private

if TYPE_CHECKING:
    from ..tasks.base import Task

HOOK = "blocks"


class NoBlocks(ValueError):
    """``blocks``/``selective`` asked for a task that does not name its blocks."""


def _saved_ops() -> frozenset:
    """The ops whose outputs ``selective`` keeps: matmuls and attention (what this torch has)."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def blocks_of(task: object, model: nn.Module) -> list[nn.Module]:
    hook = getattr(task, HOOK, None)
    if not callable(hook):
        raise NoBlocks(
            f"train.activation_checkpointing needs the task to name its blocks: "
            f"{type(task).__name__} has no {HOOK}(model) "
            f"(docs/performance.md: Activation checkpointing)"
        )
    blocks = list(hook(model))
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise NoBlocks(f"{type(task).__name__}.{HOOK}(model) must return a list of nn.Module")
    return blocks


def apply(task: object, model: nn.Module, mode: str) -> int:
    """Wrap the task's blocks in place for ``mode``; the number of blocks wrapped."""
    if mode == "none":
        return 0
    blocks = blocks_of(task, model)
    context_fn = None
    if mode == "selective":
        policy = functools.partial(_policy, _saved_ops())
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for block in blocks:
        _wrap(block, context_fn)
    return len(blocks)


def _wrap(block: nn.Module, context_fn) -> None:
    inner = block.forward
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    # A block with BatchNorm: its recomputation keeps the running statistics (_stats_kept).
    # Not while torch.compile traces it: a context_fn must then make selective checkpointing's
    # dispatch modes (an AssertionError otherwise), and the compiled recomputation does not
    # update the statistics again (seen: aot_eager's buffers equal eager's without).
    kept = (
        {"context_fn": functools.partial(_stats_kept_contexts, block, context_fn)}
        if _running_stats(block, training=None)
        else extra
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        chosen = extra if torch.compiler.is_compiling() else kept
        return checkpoint(inner, *args, use_reentrant=False, **chosen, **kwargs)

    block.forward = forward  # an instance attribute: names and state_dict keys unchanged


def _running_stats(block: nn.Module, training: bool | None = True) -> list[torch.Tensor]:
    """The buffers a training forward of ``block`` updates: BatchNorm's (any module with
    ``track_running_stats``; in train mode, unless ``training`` is None) running mean,
    variance and batch count."""
    return [
        b
        for m in block.modules()
        if getattr(m, "track_running_stats", False) and (training is None or m.training)
        for b in m.buffers(recurse=False)
    ]


@contextlib.contextmanager
def _stats_kept(block: nn.Module, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """The recomputation's context: ``block``'s running statistics as the forward left them
    (the recomputation is a second forward, which would update them a second time: a run
    with checkpointing would evaluate with other statistics than one without). Read when
    the recomputation starts, so a BatchNorm converted to SyncBatchNorm after wrapping is
    the one kept."""
    kept = [(b, b.detach().clone()) for b in _running_stats(block)]
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)


def _stats_kept_contexts(block: nn.Module, context_fn) -> tuple[Any, Any]:
    """``checkpoint``'s (forward, recompute) contexts: the mode's (selective's policy), the
    recomputation's with ``block``'s running statistics kept."""
    forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
    return forward, _stats_kept(block, recompute)


@functools.cache
def _held_mode() -> type:
    """The dispatch mode that counts held storages, built on first use: its base class is a
    private torch API (torch_private.py), which a run without this measurement never loads."""

    base: Any = torch_private.dispatch_mode_base()  # a class known only at run time

    class Held(base):
        """Every storage the ops create, weakly: what is still alive after the forward is
        what autograd (or a checkpoint) keeps for the backward."""

        def __init__(self) -> None:
            super().__init__()
            # By address: a view shares its base's storage. An address freed and reused by a
            # later tensor is that tensor's (the allocator recycles memory in the forward).
            self.made: dict[int, tuple[StorageWeakRef, int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch_private.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    s = t.untyped_storage()
                    known = self.made.get(s.data_ptr())
                    if known is None or known[0].expired():
                        self.made[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
            return out

        def alive(self, skip: set[int]) -> int:
            return sum(
                n for k, (ref, n) in self.made.items() if k not in skip and not ref.expired()
            )

    return Held


class NotMeasured(Exception):
    """Why the bytes held cannot be measured, said as it is."""


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, NotMeasured) else f"{type(e).__name__}: {e}"[:300]


def held_bytes(
    task: Task, model: nn.Module, batch: Any, autocast: contextlib.AbstractContextManager
) -> int:
    """Bytes one forward of ``batch`` leaves alive for its backward (activations)."""
    if not hasattr(task, "compute"):  # it trains through train_step alone
        raise NotMeasured("the task has no compute() to measure a forward with")
    device = next(model.parameters()).device
    kept = {name: b.detach().clone() for name, b in model.named_buffers()}
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    leaves = torch_private.tree_leaves(batch)
    own |= {t.untyped_storage().data_ptr() for t in leaves if torch.is_tensor(t)}
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type):
        held = _held_mode()()
        with held, autocast:
            result = task.compute(model, batch)
        size = held.alive(own)
        del result
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(kept[name])
    return size


def setup(
    task: object, model: nn.Module, mode: str, measure: Callable[[nn.Module], int | None]
) -> dict[str, Any] | None:
    """Apply ``mode``; with it on, the start event's figures: bytes held for the backward by
    one micro-batch without and with (``measure(model) -> bytes``, None on ranks that do not
    measure)."""
    if mode == "none":
        return None
    fields: dict[str, Any] = {"mode": mode}
    try:
        without = measure(model)
    except Exception as e:  # a probe that cannot follow the task is no reason to fail
        without, fields["not_measured"] = None, _reason(e)
    fields["blocks"] = apply(task, model, mode)
    with_ = None
    if without is not None:
        try:
            with_ = measure(model)
        except Exception as e:
            fields["not_measured"] = _reason(e)
    fields.update(held_without=without, held_with=with_)
    return fields
