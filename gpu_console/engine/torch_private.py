"""Every private or version-dependent torch API the engine uses, behind one door.

A rename in the next torch must break one function here, with its fallback or a clear
one-line refusal, never every run. Nothing here imports a private module at import time:
each is imported inside the function that needs it, and a plain DDP run calls none of the
functions below except :func:`norm_layer_types` (public classes first) and
:func:`fused_kernel_devices` (a fallback when the private list is gone).
``tests/test_torch_private.py`` fails when a module outside this one reaches a private torch
name, and calls each function here on the installed torch.

Tested on: torch 2.13.0 (CPU wheel, CI and the developers' machines); torch 2.11.0+cu130 (the
GPU machine, earlier sessions: compile, FSDP, the memory snapshot). Each use says what it
falls back to.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


class MissingTorchFeature(RuntimeError):
    """This torch lacks a private API a feature needs: the message names it, the feature and
    the torch version, in one line."""


def _missing(what: str, feature: str, e: BaseException) -> MissingTorchFeature:
    return MissingTorchFeature(
        f"{feature} needs {what}, which torch {torch.__version__} lacks "
        f"({type(e).__name__}: {e}); use a torch gpu-console supports (2.11 to 2.13)"
    )


# -- optimizers (every run) -----------------------------------------------------------------


def norm_layer_types() -> tuple[type, ...]:
    """Every normalisation layer class (their parameters never decay under ``matrices``).

    ``nn.modules.batchnorm._NormBase`` is the base of BatchNorm*, SyncBatchNorm and
    InstanceNorm*; without it, the public classes one by one."""
    public = ("LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm")
    found = tuple(getattr(nn, n) for n in public if hasattr(nn, n))
    base = getattr(nn.modules.batchnorm, "_NormBase", None)
    if isinstance(base, type):
        return (*found, base)
    batch = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
    inst = ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")
    return found + tuple(getattr(nn, n) for n in (*batch, *inst) if hasattr(nn, n))


def import_compiler() -> None:
    """``torch._dynamo`` imported now. torch.optim imports it at an optimizer's first step
    (each step is wrapped for the compiler), compiling or not, so a rank imports it with the
    rest of torch (engine/__main__.imports_without_gc), which costs nothing extra. A torch
    without it: nothing to do."""
    with contextlib.suppress(ImportError):
        import torch._dynamo  # noqa: F401


def fused_kernel_devices() -> list[str]:
    """The device types with a fused AdamW (the list AdamW itself checks ``fused=True``
    against); without the private list, CUDA only (fused AdamW's first device)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ["cuda"]
    return list(_get_fused_kernels_supported_devices())


def set_last_lr(scheduler: Any, lrs: list[float] | list[float | torch.Tensor]) -> None:
    """What ``get_last_lr()`` (the step events' lr) reads, set as the scheduler sets it.

    ``_last_lr`` is private: set all the same on a torch without it (harmless there);
    ``tests/test_torch_private.py`` checks that ``get_last_lr`` reads what is set here."""
    scheduler._last_lr = list(lrs)


def rewind_step_count(scheduler: Any, steps: int) -> None:
    """Take ``steps`` back from a scheduler's private step count (it warns when ``step()`` is
    called before the optimizer's: a rewound count must stay in line with ``last_epoch``)."""
    if hasattr(scheduler, "_step_count"):
        scheduler._step_count -= steps


# -- activation checkpointing's measurement (train.activation_checkpointing) ---------------


def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of a nested structure of lists, tuples and dicts (torch's pytree)."""
    try:
        from torch.utils._pytree import tree_leaves as leaves
    except ImportError:
        return _leaves(tree)
    return leaves(tree)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _leaves(t)]
    if isinstance(tree, dict):
        return [x for t in tree.values() for x in _leaves(t)]
    return [tree]


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: sees every op a forward runs (what activation checkpointing's
    held-bytes measurement counts). Refused in one line where this torch lacks it."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:
        raise _missing("torch.utils._python_dispatch.TorchDispatchMode",
                       "measuring activation memory", e) from None  # fmt: skip
    return TorchDispatchMode


# -- train.compile ---------------------------------------------------------------------------


def compile_for_ddp() -> None:
    """Dynamo's DDPOptimizer on (the default, said here): graphs split at DDP's buckets."""
    try:
        import torch._dynamo
    except ImportError as e:
        raise _missing("torch._dynamo", "train.compile", e) from None
    torch._dynamo.config.optimize_ddp = True


def unique_graphs() -> int | None:
    """How many graphs Dynamo compiled so far (recompiles are the growth); None when this
    torch does not count them (recompiles then go uncounted, nothing else changes)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"]["unique_graphs"])


# -- expert parallelism (a task's expert_parameters) ------------------------------------------


def ddp_ignore(model: nn.Module, names: list[str]) -> None:
    """Have the DDP about to wrap ``model`` leave these parameters alone: no all-reduce, no
    check that every rank holds the same shape (each rank holds its own experts). DDP's
    static ``_set_params_and_buffers_to_ignore_for_model`` sets the attribute below, which
    DDP's constructor reads; without the method, the attribute is set directly (what every
    torch from 1.9 to 2.13 reads)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    setter = getattr(DDP, "_set_params_and_buffers_to_ignore_for_model", None)
    if setter is not None:
        setter(model, names)
    else:
        # torch's stubs type a module's attributes as tensors or modules; DDP reads a list
        model._ddp_params_and_buffers_to_ignore = list(names)  # type: ignore[assignment]


# -- distributed.strategy = "fsdp" -----------------------------------------------------------


def fsdp_make_root(model: nn.Module) -> None:
    """Make ``model`` FSDP's root before any forward (a task's own step may call a block
    first). A torch without the hook: the first forward picks the root, as before."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return
    init = getattr(state(), "_lazy_init", None)
    if init is not None:
        init()


def load_state_dict_from_keys(keys: set[str], checkpoint_id: str) -> dict[str, Any]:
    """Only ``keys`` of a DCP checkpoint, as plain tensors (a sharded checkpoint's export)."""
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    except ImportError as e:
        raise _missing("torch.distributed.checkpoint's _load_state_dict_from_keys",
                       "reading a sharded checkpoint without its ranks", e) from None  # fmt: skip
    return _load_state_dict_from_keys(keys, checkpoint_id=checkpoint_id)


# -- hardware.memory_snapshot_on_oom ---------------------------------------------------------


def record_memory_history(max_entries: int) -> str:
    """Start recording CUDA allocations; ``on``, or why it has no effect on this torch."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        return f"no effect: torch {torch.__version__} cannot record memory history"
    record(max_entries=max_entries)
    return "on"


def dump_memory_snapshot(path: str) -> bool:
    """Write the recorded allocations to ``path``; False when this torch cannot."""
    dump = getattr(torch.cuda.memory, "_dump_snapshot", None)
    if dump is None:
        return False
    dump(path)
    return True


# -- distributed.startup_timeout_s: the process group's timeout after the first step ----------


def set_group_timeout(seconds: float, group: Any = None) -> str | None:
    """From the next collective on, ``group`` (None: the default group) waits ``seconds``;
    None when done, else why not, in a few words.

    ``torch.distributed.distributed_c10d._set_pg_timeout`` (private; torchtitan's way to a
    shorter timeout after start-up) sets the default timeout of the group's gloo or NCCL
    backend, which each later collective takes. Measured on gloo (a 2-rank collective with a
    late peer fails after the new timeout): torch 2.13.0 (CPU wheel) and 2.11.0+cu130.
    NCCL: not measured here (no two GPUs); torch documents it. Another backend gets only torch's
    warning, taken here as a refusal, as is a torch without the function."""
    import warnings
    from datetime import timedelta

    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError as e:
        return f"torch {torch.__version__} lacks _set_pg_timeout ({e})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except Exception as e:  # noqa: BLE001 - any refusal is a reason, not a crash
            return f"{type(e).__name__}: {e}"
    refused = [str(w.message) for w in caught if "timeout" in str(w.message).lower()]
    return refused[0] if refused else None
