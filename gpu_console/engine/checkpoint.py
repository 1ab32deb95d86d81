"""Checkpoints: everything an exact resume needs, written so a kill never leaves half of one.

Layout: ``checkpoints/step-00000100/{state.pt,meta.json}`` and ``checkpoints/LATEST``.
Every rank's RNG state is gathered to rank 0, the only writer. Rank 0 writes into a
temporary directory, fsyncs, renames it into place, then rewrites LATEST atomically, so
LATEST always names a complete checkpoint. Loading uses ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runs import atomic_write_text, fsync_dir, latest_checkpoint

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


def save(
    run_dir: Path,
    step: int,
    reason: str,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
    is_main: bool,
) -> dict[str, Any] | None:
    """Collective: every rank calls it at the same step. Rank 0 returns the event fields.

    At every instant LATEST names a complete checkpoint: a new one is written whole into a
    temporary directory first; a directory LATEST may name is never renamed or deleted
    while named. An OSError (a full disk) leaves LATEST and what it names untouched.
    """
    started = time.perf_counter()
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(rank_state, gathered, dst=0)
    if not is_main:
        return None
    ckpts = Path(run_dir) / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    _clean_debris(ckpts)
    name = step_dir_name(step)
    tmp = ckpts / f"{TMP}{name}-{os.getpid()}"
    final = ckpts / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        torch.save({**state, "ranks": gathered}, tmp / STATE)
        _fsync_file(tmp / STATE)
        nbytes = (tmp / STATE).stat().st_size
        meta = {"step": step, "reason": reason, "world_size": len(gathered), "t": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        _fsync_file(tmp / "meta.json")
        fsync_dir(tmp)
        if final.exists():
            _replace(ckpts, tmp, final)
        else:
            os.rename(tmp, final)
        fsync_dir(ckpts)
        atomic_write_text(ckpts / "LATEST", name + "\n")
    except BaseException:
        if _latest_name(ckpts) != tmp.name:  # a failed replace may have named it: keep it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    prune(ckpts, keep_last)
    _clean_debris(ckpts)  # what an earlier failed or killed save left, now LATEST moved on
    return {
        "step": step,
        "path": str(final),
        "seconds": round(time.perf_counter() - started, 4),
        "bytes": nbytes,
        "reason": reason,
    }


TMP, LINK = ".tmp-", ".link-"


def _replace(ckpts: Path, tmp: Path, final: Path) -> None:
    """The same step saved again (an interval checkpoint, then a stop at that step).

    ``final`` may be what LATEST names, so LATEST first moves to the new complete copy in
    ``tmp``; then ``final`` is rebuilt from ``tmp`` by hard links in a staging directory
    and renamed into place (it no longer exists, so the rename cannot fail half-way).
    """
    atomic_write_text(ckpts / "LATEST", tmp.name + "\n")
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


def _latest_name(ckpts: Path) -> str | None:
    try:
        return (ckpts / "LATEST").read_text().strip() or None
    except OSError:
        return None


def _clean_debris(ckpts: Path) -> None:
    """Temporary directories of writers that were killed, except one LATEST still names."""
    named = _latest_name(ckpts)
    for p in ckpts.iterdir():
        if p.name.startswith((TMP, LINK, ".old-")) and p.name != named:
            shutil.rmtree(p, ignore_errors=True)


def prune(ckpts: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in ckpts.glob("step-*") if (p / "meta.json").is_file())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / STATE, map_location="cpu", weights_only=True)


def find_latest(run_dir: Path) -> Path | None:
    return latest_checkpoint(run_dir)
