"""``export RUN [--best | --step N] --out FILE``: the model's plain state_dict(s), for plain
PyTorch code (no gpu-console needed to load them).

Which checkpoint is chosen here, from the run directory alone (LATEST, BEST, or a step);
the file is written by ``python -m gpu_console.engine.export`` in a subprocess, since the
console never imports torch. Every bad input is an :class:`ExportError` before anything is
written; the subprocess writes FILE whole or not at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..runs import (
    RunDirError,
    best_checkpoint,
    find_run,
    hold_checkpoints,
    list_checkpoints,
    read_json,
    resume_checkpoint,
)


class ExportError(RunDirError):
    """An export that cannot be made as asked (exit 2, one line)."""


def choose(run: Path, best: bool, step: int | None) -> tuple[Path, str]:
    """The checkpoint to export: LATEST, BEST (``--best``) or ``step-N`` (``--step N``), and
    why it is not LATEST's when LATEST's cannot be used ("" otherwise): the same fallback as
    ``--resume`` (runs.resume_checkpoint), so the two never disagree."""
    if best and step is not None:
        raise ExportError("--best and --step: give one of them")
    if best:
        found = best_checkpoint(run)
        if found is None:
            raise ExportError(f"--best: {run}: {_why_no_best(run)}")
        return found, ""
    if step is not None:
        for c in list_checkpoints(run):
            if c["step"] == step:
                return Path(c["path"]), ""
        have = ", ".join(str(c["step"]) for c in list_checkpoints(run)) or "none"
        raise ExportError(f"--step: {run}: no complete checkpoint at step {step} (on disk: {have})")
    found, why = resume_checkpoint(run)
    if found is None:
        raise ExportError(f"{run}: {why or 'has no complete checkpoint to export'}")
    return found, why.replace("resuming from", "exporting")


def _why_no_best(run: Path) -> str:
    from ..profile import ProfileError, parse_toml

    try:
        ckpt = parse_toml(run / "run.toml").get("checkpoint")
    except ProfileError:
        ckpt = None
    metric = ckpt.get("keep_best") if isinstance(ckpt, dict) else None
    if not metric:
        return "no best checkpoint: the run did not keep one (checkpoint.keep_best is off)"
    return f"no best checkpoint yet (checkpoint.keep_best = {metric!r}: no eval has been judged)"


def check_out(out: Path) -> Path:
    if out.is_dir():
        raise ExportError(f"--out: {out}: a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"--out: {out}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out: {out}: its directory {parent} is not writable")
    return out


def export(run_arg: str, runs_dir: Path, out: Path, best: bool, step: int | None) -> dict:
    """Export; return what was written (path, bytes, step, checkpoint, keys per state_dict)."""
    run = find_run(run_arg, runs_dir)
    if not (run / "run.toml").is_file():  # a half-deleted run (runs.damage)
        raise ExportError(
            f"{run}: run.toml is missing, and the model is built from it to load the "
            "checkpoint; restore it (history/run-N.toml keeps each earlier session's)"
        )
    out = check_out(Path(out))
    # Held while it is read: a live run does not prune it under the export.
    with hold_checkpoints(run):
        ckpt, why = choose(run, best, step)
        proc = subprocess.run(
            [sys.executable, "-m", "gpu_console.engine.export", str(ckpt), str(out), str(run)],
            capture_output=True,
            text=True,
            env=_env(),
        )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        raise ExportError(f"export of {ckpt}: {lines[-1]}")
    written: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    written["best"] = best or _is_best(ckpt)
    written["note"] = why
    return written


def _is_best(ckpt: Path) -> bool:
    meta = read_json(ckpt / "meta.json")
    return isinstance(meta, dict) and meta.get("best") is True


def _env() -> dict[str, str]:
    """The subprocess imports this very gpu_console (a checkout run from its directory); an
    installed one is found there anyway (site-packages is never put ahead of the stdlib)."""
    env = dict(os.environ)
    here = Path(__file__).resolve().parents[2]
    if here.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), env.get("PYTHONPATH")) if p)
    return env


def describe(written: dict[str, Any]) -> str:
    """``FILE: 1,234 bytes, step 40 (best), 6 tensors`` (per state_dict where several)."""
    keys = written["keys"]
    counts = (
        f"{keys['']} keys"
        if list(keys) == [""]
        else ", ".join(f"{name}: {n} keys" for name, n in keys.items())
    )
    best = " (best)" if written.get("best") else ""
    line = (
        f"{written['path']}: {written['bytes']:,} bytes, step {written['step']}{best}, {counts}"
        f" (from {written['checkpoint']})"
    )
    return f"note: {written['note']}\n{line}" if written.get("note") else line
