"""Checkpoints of an FSDP run: every rank writes its own shards (``torch.distributed.checkpoint``).

The same layout and promises as checkpoint.py: ``checkpoints/step-N/`` holds the model's and
the optimizers' shards (DCP's ``.metadata`` and one ``__R_0.distcp`` per rank), ``state.pt``
(everything else, written by rank 0: schedules, scaler, step, data position, every rank's RNG
and task state) and ``meta.json``, written last. All ranks write into a temporary directory
rank 0 named; only once every rank's shards and rank 0's files are fsynced does rank 0 rename
it into place and move LATEST (and BEST), then prune to ``keep_last``.

Resume loads the shards into this run's sharding, whatever the world size that wrote them
(DCP reshards on load); state.pt as checkpoint.py's. Several nodes need one file system
every rank writes to (the runs directory rank 0 names).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .. import diskfull, strict_json
from ..runs import atomic_write_text, fsync_dir
from . import checkpoint as plain
from . import torch_private
from .checkpoint import BEST, STATE, TMP, Resumed, _fsync_file, step_dir_name
from .optim_build import ParamGroupError

WHOLE = ("model", "optimizers", "optimizer", "scheduler")
FORMAT = "dcp"  # state.pt's "sharded": how the model and optimizers are stored


class StrategyMismatch(ValueError):
    """A checkpoint written under the other ``distributed.strategy``."""


def is_sharded(path: Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def _sharded_state(model, optimizers) -> dict[str, Any]:
    """The DCP part: the model's and each optimizer's state, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as opt_state

    return {
        "model": get_model_state_dict(model),
        "optimizers": {e.name: opt_state(model, e.optimizer) for e in optimizers.entries},
    }


def save(
    run_dir: Path,
    step: int,
    reason: str,
    model,
    optimizers,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
    is_main: bool,
    group: dist.ProcessGroup | None = None,
    best: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective: checkpoint.save's contract (every rank gets rank 0's outcome), sharded.

    ``state``: what checkpoint.save would write, without the model and optimizers (those are
    taken from ``model`` and ``optimizers`` here, as shards).
    """
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    # The whole-model and optimizer entries are the shards' business here.
    state = {k: v for k, v in state.items() if k not in WHOLE}
    state["optimizer_names"] = [e.name for e in optimizers.entries]
    ckpts = Path(run_dir) / "checkpoints"
    name = step_dir_name(step)
    where: list[Any] = [None]
    if is_main:
        try:
            ckpts.mkdir(parents=True, exist_ok=True)
            plain._clean_debris(ckpts)
            tmp = ckpts / f"{TMP}{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            where[0] = {"tmp": str(tmp)}
        except OSError as e:
            where[0] = {"error": _full_or(e, ckpts)}
    dist.broadcast_object_list(where, src=0, group=group)
    if "error" in where[0]:
        return plain.failed_outcome(run_dir, where[0]["error"])
    tmp = Path(where[0]["tmp"])
    error = None
    # Before the first update DCP gives an optimizer state by stepping it with zero
    # gradients at lr 0 (Adam's step count becomes 1): the run itself goes on without it.
    fresh = [e.optimizer for e in optimizers.entries if not e.optimizer.state]
    try:  # DCP gathers every rank's failure: all ranks see one if any rank's write failed
        dcp.save(_sharded_state(model, optimizers), checkpoint_id=tmp, process_group=group)
    except CheckpointException as e:  # a BaseException: never a bare Exception
        error = _first_failure(e, tmp)
    except OSError as e:
        error = _full_or(e, tmp)
    for optimizer in fresh:
        optimizer.state.clear()
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(rank_state, gathered, dst=0, group=group)
    outcome: list[dict[str, Any] | None] = [None]
    if is_main:
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome[0] = plain.failed_outcome(run_dir, _freed(error, ckpts))
        else:
            try:
                event = _finish(ckpts, tmp, step, reason, state, gathered, keep_last, best)
                seconds = round(time.perf_counter() - started, 4)
                # Synchronous: training was blocked for all of it (checkpoint.save's fields).
                event.update(seconds=seconds, blocked_s=seconds, waited_s=0.0)
                outcome[0] = {"ok": True, "event": event}
            except OSError as e:  # a full disk among them (_finish)
                outcome[0] = plain.failed_outcome(run_dir, e)
    dist.broadcast_object_list(outcome, src=0, group=group)
    assert outcome[0] is not None
    return outcome[0]


def _first_failure(e: CheckpointException, tmp: Path) -> str | diskfull.DiskFull:
    """The first failing rank's error in one line (``rank 1: [Errno 13] Permission denied``),
    not DCP's tracebacks; a full disk as itself (any rank's: the file system is shared)."""
    for _rank, (exc, _trace) in sorted(e.failures.items()):
        if isinstance(exc, Exception) and (full := diskfull.classify(exc, tmp)) is not None:
            return full
    for rank, (exc, _trace) in sorted(e.failures.items()):
        return f"rank {rank}: {exc}"[:500]
    return str(e).splitlines()[0][:500]


def _full_or(e: OSError, where: Path) -> str | diskfull.DiskFull:
    return diskfull.classify(e, where) or str(e)


def _freed(error: str | diskfull.DiskFull, ckpts: Path) -> str | diskfull.DiskFull:
    """A full disk's free space once the half-written shards are gone."""
    if isinstance(error, diskfull.DiskFull):
        error.free = diskfull.free_bytes(ckpts)
    return error


def _finish(
    ckpts: Path,
    tmp: Path,
    step: int,
    reason: str,
    state: dict[str, Any],
    gathered: list | None,
    keep_last: int,
    best: dict[str, Any] | None,
) -> dict[str, Any]:
    """Rank 0, once every rank's shards are in ``tmp``: its own files, then into place."""
    assert gathered is not None
    final = ckpts / tmp.name[len(TMP) :].rsplit("-", 1)[0]
    try:
        plain._save_state({**state, "ranks": gathered, "sharded": FORMAT}, tmp / STATE)
        meta = {
            "step": step,
            "reason": reason,
            "world_size": len(gathered),
            "t": time.time(),
            "strategy": "fsdp",
        }
        if best is not None:
            meta.update(best_so_far=best["so_far"], best=best["is_best"])
        if state.get("early_stop"):  # for the console's launch checks (no torch there)
            meta["early_stop"] = state["early_stop"]
        (tmp / "meta.json").write_text(strict_json.dumps(meta) + "\n")
        _fsync_file(tmp / "meta.json")
        fsync_dir(tmp)
        nbytes = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
        if final.exists():
            plain._replace(ckpts, tmp, final)
        else:
            os.rename(tmp, final)
        fsync_dir(ckpts)
        atomic_write_text(ckpts / "LATEST", final.name + "\n")
        if (best is not None and best["is_best"]) or plain._named(ckpts, BEST) == tmp.name:
            atomic_write_text(ckpts / BEST, final.name + "\n")
    except BaseException as e:
        full = plain._as_disk_full(e, ckpts, state, gathered, tmp)
        if tmp.name not in plain._names(ckpts):
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            full.free = diskfull.free_bytes(ckpts)
            raise full from e
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    plain.prune(ckpts, keep_last)
    plain._clean_debris(ckpts)
    event = {"step": step, "path": str(final), "bytes": nbytes, "reason": reason, "sharded": True}
    if best is not None and best["is_best"]:
        event.update(best=True, metric=best["so_far"]["metric"], value=best["so_far"]["value"])
    return event


def resume(path: Path, model, optimizers, scaler, rank: int, world_size: int) -> Resumed:
    """Load a sharded checkpoint into the sharded model and its optimizers (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from .resume import Settings

    path = Path(path)
    if not is_sharded(path):
        raise StrategyMismatch(
            f"{path} was written under distributed.strategy = 'ddp': resume it with ddp "
            "(its state.pt holds the whole model, not FSDP shards)"
        )
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    shards = _sharded_state(model, optimizers)
    names = sorted(e.name for e in optimizers.entries)
    if sorted(state["optimizer_names"]) != names:
        raise ParamGroupError(
            f"the checkpoint holds optimizers {sorted(state['optimizer_names'])}, this run "
            f"builds {names}"
        )
    dcp.load(shards, checkpoint_id=path)
    set_model_state_dict(model, shards["model"])
    scheds = state.get("schedulers") or {}
    for e in optimizers.entries:
        settings = Settings.of(e.optimizer, e.scheduler) if e.own_settings else None
        set_optimizer_state_dict(model, e.optimizer, shards["optimizers"][e.name])
        if e.scheduler is not None and scheds.get(e.name) is not None:
            e.scheduler.load_state_dict(scheds[e.name])
        if settings is not None:
            settings.restore(e.optimizer, e.scheduler)
    return plain.resumed_rest(state, scaler, rank, world_size)


def model_state(path: Path) -> dict[str, Any]:
    """The whole model's state_dict from a sharded checkpoint, in this process (no process
    group: what ``gpu-console export`` runs)."""
    return torch_private.load_state_dict_from_keys({"model"}, str(path))["model"]
