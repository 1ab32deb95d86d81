"""Checkpoints: everything an exact resume needs, written so a kill never leaves half of one.

Layout: ``checkpoints/step-00000100/{state.pt,meta.json}`` and ``checkpoints/LATEST``.
Every rank's RNG state (and the task's state, hooks.py) is gathered to rank 0, the only
writer, and saved per rank in the one file. Rank 0 writes into a temporary directory,
fsyncs, renames it into place, then rewrites LATEST atomically, so LATEST always names a
complete checkpoint (every rank's part included). Loading uses ``weights_only=True``.

While rank 0 writes, the other ranks wait for its outcome on a group of their own
(:func:`write_group`: gloo, with a timeout no write outlasts), not in the next training
collective, whose timeout (``distributed.collective_timeout_s``) a slow disk would exceed.
Every rank returns the same outcome, so every node knows when a checkpoint failed.

This is the synchronous path (``checkpoint.async_write = false``) and what the background
write runs (checkpoint_writer.py: training blocks only for a copy of the state).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import diskfull, strict_json
from ..runs import HOLD, atomic_write_text, fsync_dir, latest_checkpoint

if TYPE_CHECKING:
    from ..profile import CheckpointConfig
    from .optim_set import Optimizers
    from .strategy import Scalers

STATE = "state.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def capture_rng(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_python_state(s: Any) -> tuple:
    # weights_only unpickling may hand tuples back as lists.
    return (s[0], tuple(s[1]), s[2])


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# How long the other ranks wait for rank 0's write. A store-based wait would do as well, but
# only a process group's timeout is public API; gloo, because its collectives wait on the CPU
# (a CUDA run's NCCL collectives have a watchdog of their own).
WRITE_WAIT_S = 6 * 3600


def write_group(collective_timeout_s: float) -> dist.ProcessGroup:
    """Collective (every rank, once, at setup): where ranks wait for rank 0's write."""
    wait = max(WRITE_WAIT_S, collective_timeout_s)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=wait))


def save(
    run_dir: Path,
    step: int,
    reason: str,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
    is_main: bool,
    group: dist.ProcessGroup | None = None,
    best: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective: every rank calls it at the same step, and every rank gets rank 0's outcome.

    ``{"ok": True, "event": {...}}`` (the checkpoint event's fields), or, when rank 0 could
    not write it (an OSError; a full disk is one whatever torch raised: :func:`_write`),
    ``{"ok": False, "error": ..., "latest": ...}``
    with the name LATEST still holds. At every instant LATEST names a complete checkpoint:
    a new one is written whole into a temporary directory first; a directory LATEST may
    name is never renamed or deleted while named. A failure leaves LATEST and what it names
    untouched. The ranks wait for the outcome on ``group`` (:func:`write_group`).
    ``best``: :meth:`best.Best.for_save`'s (``checkpoint.keep_best``), or None.
    """
    started = time.perf_counter()
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(rank_state, gathered, dst=0)
    outcome: list[dict[str, Any] | None] = [None]
    if is_main:
        assert gathered is not None
        ckpts = Path(run_dir) / "checkpoints"
        try:
            writing = time.perf_counter()
            event = _write(ckpts, step, reason, state, gathered, keep_last, best)
            seconds = round(time.perf_counter() - started, 4)
            # Synchronous: training was blocked for all of it.
            event.update(seconds=seconds, blocked_s=seconds, waited_s=0.0)
            event["write_s"] = round(time.perf_counter() - writing, 4)
            outcome[0] = {"ok": True, "event": event}
        except OSError as e:
            outcome[0] = failed_outcome(run_dir, e)
    # Any other exception leaves rank 0 here: torchrun then ends the waiting ranks.
    dist.broadcast_object_list(outcome, src=0, group=group)
    assert outcome[0] is not None
    return outcome[0]


@dataclass
class Newest:
    """The newest checkpoint this session wrote (its event's fields, the same on every rank
    once the write in flight has been waited for: read it only then).

    A step is checkpointed once: a request at that step (an interval's, or a request while
    paused) is answered with it, and the interval at the run's last step is left to the end
    checkpoint, which every profile's run then ends with (reason ``end``).
    """

    event: dict[str, Any] | None = None

    def at(self, step: int) -> dict[str, Any] | None:
        return self.event if self.event is not None and self.event["step"] == step else None


def interval_due(step: int, cfg: CheckpointConfig, max_steps: float) -> bool:
    """An interval checkpoint after ``step`` (``cfg``: the profile's [checkpoint];
    ``max_steps``: the last step, ``math.inf`` for a run until stopped)."""
    if cfg.at_end and step >= max_steps:
        return False  # the end checkpoint is this step's
    return bool(cfg.every_steps and step % cfg.every_steps == 0)


def due(step: int, cfg: CheckpointConfig, max_steps: float, improved: bool) -> str | None:
    """Why a checkpoint is due after ``step``'s eval: its interval, or a new best eval
    (``improved``; at the last step the end checkpoint is the best's)."""
    if interval_due(step, cfg, max_steps):
        return "interval"
    if improved and not (cfg.at_end and step >= max_steps):
        return "best"
    return None


def failed_outcome(run_dir: Path, e: OSError | str) -> dict[str, Any]:
    """A write that failed (every writer's): why, in one line, and what LATEST still names."""
    previous = latest_checkpoint(run_dir)
    out = {"ok": False, "error": str(e), "latest": previous and previous.name}
    if isinstance(e, diskfull.DiskFull):
        out["free_bytes"] = e.free
    return out


def failure(step: int, reason: str, outcome: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A failed save's error line, and its fields for the supervisor (``checkpoint_failed``)."""
    previous = outcome["latest"]
    kept = f"LATEST stays at {previous}" if previous else "there is no earlier checkpoint"
    message = f"checkpoint @ step {step} ({reason}) not written: {outcome['error']}"
    fields = {"step": step, "reason": reason, "error": outcome["error"], "latest": previous}
    if "free_bytes" in outcome:
        fields["free_bytes"] = outcome["free_bytes"]
    return f"{message}; {kept}", fields


# Test-only seam: seconds the write sleeps before serialising and again before the rename,
# so a test can act while a (background) write is in flight. Never set in real runs.
DELAY_ENV = "GPU_CONSOLE_TEST_CHECKPOINT_DELAY_S"


def _test_delay() -> None:
    if delay := float(os.environ.get(DELAY_ENV) or 0):
        time.sleep(delay)


def _write(
    ckpts: Path,
    step: int,
    reason: str,
    state: dict[str, Any],
    gathered: list,
    keep_last: int,
    best: dict[str, Any] | None = None,
) -> dict[str, Any]:
    ckpts.mkdir(parents=True, exist_ok=True)
    _clean_debris(ckpts)
    name = step_dir_name(step)
    tmp = ckpts / f"{TMP}{name}-{os.getpid()}"
    final = ckpts / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _test_delay()
        _save_state({**state, "ranks": gathered}, tmp / STATE)
        nbytes = (tmp / STATE).stat().st_size
        meta = {"step": step, "reason": reason, "world_size": len(gathered), "t": time.time()}
        if best is not None:
            meta.update(best_so_far=best["so_far"], best=best["is_best"])
        if state.get("early_stop"):  # for the console's launch checks (no torch there)
            meta["early_stop"] = state["early_stop"]
        (tmp / "meta.json").write_text(strict_json.dumps(meta) + "\n")
        _fsync_file(tmp / "meta.json")
        fsync_dir(tmp)
        _test_delay()
        if final.exists():
            _replace(ckpts, tmp, final)
        else:
            os.rename(tmp, final)
        fsync_dir(ckpts)
        atomic_write_text(ckpts / "LATEST", name + "\n")
        if (best is not None and best["is_best"]) or _named(ckpts, BEST) == tmp.name:
            atomic_write_text(ckpts / BEST, name + "\n")
    except BaseException as e:
        # Classified before the half-written files go: they are what filled the disk.
        full = _as_disk_full(e, ckpts, state, gathered, tmp)
        if tmp.name not in _names(ckpts):  # a failed replace may have named it: keep it
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            full.free = diskfull.free_bytes(ckpts)  # what is free once they are gone
            raise full from e
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    prune(ckpts, keep_last)
    _clean_debris(ckpts)  # what an earlier failed or killed save left, now LATEST moved on
    event = {"step": step, "path": str(final), "bytes": nbytes, "reason": reason}
    if best is not None and best["is_best"]:
        event.update(best=True, metric=best["so_far"]["metric"], value=best["so_far"]["value"])
    return event


def _save_state(obj: dict[str, Any], path: Path) -> None:
    """torch.save through a Python file: a failed write then leaves its OSError (and its
    errno: ENOSPC, EDQUOT) in the context of torch's RuntimeError, which a write to a path
    does not."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _as_disk_full(e: BaseException, ckpts: Path, state, gathered, tmp: Path):
    """``e`` as a :class:`diskfull.DiskFull` when the disk was full, else None."""
    if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
        return None
    return diskfull.classify(e, ckpts, _still_needed(state, gathered, tmp))


def _still_needed(state: dict[str, Any], gathered: list, tmp: Path) -> int:
    """About how many bytes the write still had to write when it failed."""
    total = sum(t.element_size() * t.numel() for t in _tensors([state, gathered]))
    try:
        written = sum(f.stat().st_size for f in tmp.iterdir())
    except OSError:
        written = 0
    return max(total - written, 0)


TMP, LINK = ".tmp-", ".link-"
BEST = "BEST"  # names the best checkpoint (checkpoint.keep_best; engine/best.py)


def _replace(ckpts: Path, tmp: Path, final: Path) -> None:
    """The same step saved again (an interval checkpoint, then a stop at that step).

    ``final`` may be what LATEST names, so LATEST first moves to the new complete copy in
    ``tmp``; then ``final`` is rebuilt from ``tmp`` by hard links in a staging directory
    and renamed into place (it no longer exists, so the rename cannot fail half-way).
    """
    atomic_write_text(ckpts / "LATEST", tmp.name + "\n")
    if _named(ckpts, BEST) == final.name:  # the same step's weights: BEST never names nothing
        atomic_write_text(ckpts / BEST, tmp.name + "\n")
    shutil.rmtree(final)
    staging = ckpts / f"{LINK}{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "meta.json"):  # meta.json last
        try:
            os.link(f, staging / f.name)
        except OSError:  # a file system without hard links
            shutil.copy2(f, staging / f.name)
            _fsync_file(staging / f.name)
    fsync_dir(staging)
    os.rename(staging, final)


def _named(ckpts: Path, which: str) -> str | None:
    try:
        return (ckpts / which).read_text().strip() or None
    except OSError:
        return None


def _names(ckpts: Path) -> set[str | None]:
    """What LATEST and BEST name."""
    return {_named(ckpts, "LATEST"), _named(ckpts, BEST)}


def _clean_debris(ckpts: Path) -> None:
    """Temporary directories of writers that were killed, except one LATEST or BEST names."""
    named = _names(ckpts)
    for p in ckpts.iterdir():
        if p.name.startswith((TMP, LINK, ".old-")) and p.name not in named:
            shutil.rmtree(p, ignore_errors=True)


def prune(ckpts: Path, keep_last: int) -> None:
    """All but the newest ``keep_last`` complete checkpoints, except the one BEST names; not
    while a reader holds them (``runs.hold_checkpoints``: an export reading one), when the
    next checkpoint prunes instead."""
    if keep_last <= 0:
        return
    try:  # made by a reader only (runs.hold_checkpoints): none, no reader has held them
        fd = os.open(ckpts / HOLD, os.O_RDONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return
    try:
        _prune(ckpts, keep_last)
    finally:
        if fd is not None:
            os.close(fd)


def _prune(ckpts: Path, keep_last: int) -> None:
    complete = sorted(p for p in ckpts.glob("step-*") if (p / "meta.json").is_file())
    best = _named(ckpts, BEST)
    for old in complete[:-keep_last]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)


def load(path: Path) -> dict[str, Any]:
    """The checkpoint's dict, its tensors mapped from the file (pages read as they are used)."""
    return torch.load(Path(path) / STATE, map_location="cpu", mmap=True, weights_only=True)


@dataclass
class Resumed:
    step: int
    data: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's RNG state; None when the world size changed
    ranks: int  # how many ranks' RNG states the checkpoint holds
    world_size: int  # the world size of the run that wrote it
    task: list[Any] | None = None  # each saving rank's task state (None: the task kept none)
    evaluated_at: int | None = None  # the step of the run's newest eval (None: not recorded)
    early_stop: dict[str, Any] | None = None  # train.early_stop_metric's count (early_stop.py)


def resume(
    path: Path,
    model: torch.nn.Module,
    optimizers: Optimizers,
    scaler: Scalers,
    rank: int,
    world_size: int,
) -> Resumed:
    """Load a checkpoint into the run's objects and drop it: nothing of it stays referenced.

    The file is memory-mapped, so no rank holds a second copy of it in memory while loading
    (the mapped pages are the page cache's). ``optimizers``: the run's (optim_set.py), which
    read the layout by name and the one before it (a single ``optimizer``).
    """
    return resume_state(load(path), model, optimizers, scaler, rank, world_size)


def resume_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizers: Optimizers,
    scaler: Scalers,
    rank: int,
    world_size: int,
) -> Resumed:
    """:func:`resume` of a checkpoint's dict already read (a strategy may reshape it first:
    strategy_expert.py takes this rank's experts out of the whole)."""
    model.load_state_dict(state["model"])
    optimizers.load_state_dict(state)  # or why their groups do not fit
    loaded = _tensors(state.get("optimizers") or state["optimizer"])
    for entry in optimizers.entries:
        _own_optimizer_state(entry.optimizer, loaded)
    return resumed_rest(state, scaler, rank, world_size)


def resumed_rest(state: dict[str, Any], scaler: Scalers, rank: int, world_size: int) -> Resumed:
    """What every checkpoint layout keeps in its state dict (sharded ones too): the scaler(s)
    loaded, and the step, data position, this rank's RNG and the task states read."""
    if isinstance(scaler, dict):  # a task's own step: one per optimizer, by name
        for name, one in scaler.items():
            if (state.get("scaler") or {}).get(name):
                one.load_state_dict(state["scaler"][name])
    elif scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    ranks = state.get("ranks") or []
    rng = ranks[rank]["rng"] if len(ranks) == world_size else None
    world = int(state.get("world_size") or len(ranks) or 1)
    task = [r.get("task") for r in ranks] if any("task" in r for r in ranks) else None
    evaluated_at = state.get("evaluated_at")
    early = state.get("early_stop")
    return Resumed(
        int(state["step"]), dict(state["data"]), rng, len(ranks), world, task, evaluated_at,
        dict(early) if isinstance(early, dict) else None,
    )  # fmt: skip


def scaler_state(scaler: Scalers) -> dict[str, Any] | None:
    """The GradScaler's state; a dict of them by optimizer name (a task's own step)."""
    if isinstance(scaler, dict):
        return {name: one.state_dict() for name, one in scaler.items()}
    return scaler.state_dict() if scaler is not None else None


def _own_optimizer_state(optimizer: torch.optim.Optimizer, loaded: list[torch.Tensor]) -> None:
    """Copy out of the mapping the state tensors the optimizer kept as it was handed them.

    ``Optimizer.load_state_dict`` keeps a tensor whose dtype and device already match its
    parameter's (a CPU run) instead of copying it, which would tie the run to the file's
    mapping (a file a later prune deletes, on another node's file system too). Copied one
    tensor at a time; on a GPU the optimizer made its own copies and nothing is copied here.
    """
    mapped = {p for t in loaded if (p := t.untyped_storage().data_ptr())}
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in mapped:
                per_param[key] = value.clone()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def step_of(path: Path | None) -> int:
    """The step a checkpoint directory holds, from its meta.json (0: none, or unreadable)."""
    if path is None:
        return 0
    try:
        return int(json.loads((Path(path) / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def find_latest(run_dir: Path) -> Path | None:
    return latest_checkpoint(run_dir)
