"""A resume's changed ``[task]`` keys judged before launch: by the task's ``resume_keys``, else
by whether the checkpoint's model loads into the one the new keys build (no torch here).

A SLURM job that resumes its run with a new scratch path (``task.data_dir``) changes no
weight: the resume goes on with a warning naming the key. A key that changes the model (a
hidden size) is refused in one line naming it. The judgement is
``python -m gpu_console.engine.model_match`` (a subprocess, in the directory the run was
launched from, as a user task is found there), made only when a ``[task]`` key changed, once
per process: ``launch.prepare`` (and so ``--dry-run``) judges, ``launch.start`` and the
multi-node path reuse the verdicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import runs
from .resume_changes import Change, judge, judged_keys

JUDGE_TIMEOUT_S = 300

# (checkpoint, the new [task] table, the changed keys) → verdicts, for this process's launch.
_verdicts: dict[tuple[str, str, tuple[str, ...]], dict[str, Any]] = {}


class ModelCheckError(Exception):
    """The judgement could not be made (the task raised building its model): what went
    wrong, blamed on ``key`` and its new ``value``."""

    def __init__(self, key: str, problem: str, value: Any):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem, self.value = key, problem, value


def judged(
    changes: list[Change], run: Path, profile: dict[str, Any], cwd: str | None
) -> list[Change]:
    """``changes`` with each changed ``[task]`` key judged (the others as they are);
    ``profile``: the new resolved profile (``Profile.to_dict``)."""
    keys = judged_keys(changes)
    if not keys:
        return changes  # a plain resume: no subprocess
    ckpt, _ = runs.resume_checkpoint(run)
    if ckpt is None:
        return changes  # nothing to resume from: refused elsewhere
    task = json.dumps(profile.get("task"), sort_keys=True, default=str)
    memo = (str(ckpt.resolve()), task, tuple(c.key for c in keys))
    if memo not in _verdicts:
        # The run's own directory, where a user task's module is found (if it is still there).
        here = cwd if cwd and os.path.isdir(cwd) else os.getcwd()
        _verdicts[memo] = _ask(profile, ckpt, keys, here)
    return judge(changes, _verdicts[memo])


def _ask(profile: dict[str, Any], ckpt: Path, keys: list[Change], cwd: str) -> dict[str, Any]:
    doc = {
        "profile": profile,
        "checkpoint": str(ckpt.resolve()),
        "keys": [c.key for c in keys],
        "start_step": _step(ckpt),
    }
    # The model is built on the meta device or the CPU: no GPU is initialised for it.
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    first = keys[0]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gpu_console.engine.model_match"],
            input=json.dumps(doc), capture_output=True, text=True, cwd=cwd, env=env,
            timeout=JUDGE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        why = f"building the model to compare with the checkpoint took over {JUDGE_TIMEOUT_S} s"
        raise ModelCheckError(first.key, why, first.new) from None
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        why = f"the model it builds could not be compared with the checkpoint ({last[0]})"
        raise ModelCheckError(first.key, why, first.new) from None
    if "error" in answer:
        key = answer.get("key") or first.key
        value = next((c.new for c in keys if c.key == key), first.new)
        why = f"a resumed run builds its model to compare with the checkpoint: {answer['error']}"
        raise ModelCheckError(key, why, value)
    return {k: tuple(v) for k, v in answer["verdicts"].items()}


def _step(ckpt: Path) -> int:
    meta = runs.read_json(ckpt / "meta.json")
    step = meta.get("step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) else 0
