"""``python -m gpu_console.engine.model_match``: may a resume change these ``[task]`` keys?

``--resume`` with a changed ``[task]`` key (a job's new scratch path in ``task.data_dir``)
asks this subprocess (the console never imports torch: gpu_console/resume_model.py). It reads
``{"profile": ..., "checkpoint": ..., "keys": ["task.data_dir", ...], "start_step": N}`` (the
new resolved profile, the checkpoint the resume starts from, the changed keys) on stdin. A
key the task declares in its ``resume_keys`` is judged by the task's word; the others by
whether the checkpoint's model loads into the one the new keys build: the model's state_dict
names and shapes against the checkpoint's, read without loading a weight (state.pt mapped,
an FSDP checkpoint's DCP metadata). The model is built on the meta device where the task
allows it, else on the CPU. It prints one JSON line: ``{"verdicts": {key: [class, why]},
"built": bool}``, or ``{"error": ..., "key": ...}`` naming the task and what failed. Nothing
is written (the task's planning directory is a temporary one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..profile import Profile, resolve
from ..resume_changes import (
    REFUSED,
    TASK_ACCEPTS,
    TASK_DOES_NOT_LOAD,
    TASK_LOADS,
    TASK_REFUSES,
    WARNING,
)
from ..tasks.loader import TaskLoadError, load_task_class
from .checkpoint import STATE
from .context import planning
from .export import plain_keys
from .plan import SOURCE, TaskBuildError, _caller, _last_line, _task
from .sharded_checkpoint import is_sharded
from .task_parts import TaskParts

VERDICTS = {"accept": (WARNING, TASK_ACCEPTS), "refuse": (REFUSED, TASK_REFUSES)}
SHOWN = 2  # differences named in a refusal; the rest counted


def declared(task_cls: type, kind: str, keys: list[str]) -> dict[str, tuple[str, str]]:
    """The task's own word (``resume_keys``: its key names to "accept" or "refuse", or to
    ``(verdict, why)``) on the changed ``keys`` it names; every entry is checked."""
    table = getattr(task_cls, "resume_keys", None)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise TaskBuildError(f"task {kind}: resume_keys must be a dict (got {table!r})")
    words: dict[str, tuple[str, str]] = {}
    for name, word in table.items():
        verdict, why = (word, "") if isinstance(word, str) else (tuple(word) + ("", ""))[:2]
        if not isinstance(word, (str, tuple, list)) or verdict not in VERDICTS:
            raise TaskBuildError(
                f"task {kind}: resume_keys[{name!r}] must be 'accept', 'refuse' or "
                f"(verdict, why) (got {word!r})"
            )
        cls, default = VERDICTS[verdict]
        words[f"task.{name}"] = (cls, str(why or default))
    return {k: words[k] for k in keys if k in words}


def model_shapes(p: Profile, start_step: int) -> dict[str, list[int]]:
    """The state_dict names and shapes of the model the task builds from ``p``: as the loop
    builds it on a resume (its context attached, ``ctx.resumed``), on the meta device where
    the task allows it, else on the CPU."""
    kind = p.task_kind
    p, task = _task(p)
    with planning(p, 1, "cpu") as ctx:
        ctx.resumed, ctx.start_step, ctx.step = True, start_step, start_step
        try:
            model = TaskParts(task, ctx, p.train.seed).model(device="meta")
        except Exception:  # a task that needs real tensors (a value read, a weight loaded)
            model = TaskParts(task, ctx, p.train.seed, _caller(kind)).model()
        return shapes(model.state_dict())


def shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """Names (as the bare model has them) and shapes of a state_dict's tensors."""
    return {k: list(v.shape) for k, v in plain_keys(state).items() if isinstance(v, torch.Tensor)}


def checkpoint_shapes(path: Path) -> dict[str, list[int]]:
    """The checkpoint's model names and shapes, no weight read: an FSDP checkpoint's from
    its DCP metadata, a plain one's from state.pt mapped (its tensors' pages never touched)."""
    path = Path(path)
    if is_sharded(path):
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        found = {k[len("model.") :]: m for k, m in meta.items() if k.startswith("model.")}
        return {k: list(m.size) for k, m in plain_keys(found).items() if hasattr(m, "size")}
    state = torch.load(path / STATE, map_location="cpu", mmap=True, weights_only=True)
    return shapes(state["model"])


def mismatch(saved: dict[str, list[int]], built: dict[str, list[int]]) -> str | None:
    """None when the checkpoint's model loads into the built one (the same names, each
    with the same shape); else its first differences, in the model's order."""
    problems = []
    for name in [*built, *(k for k in saved if k not in built)]:
        if name not in saved:
            problems.append(f"{name}: not in the checkpoint")
        elif name not in built:
            problems.append(f"{name}: in the checkpoint, not in the model it builds")
        elif saved[name] != built[name]:
            problems.append(f"{name}: {saved[name]} in the checkpoint, {built[name]} now")
    if not problems:
        return None
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return "; ".join(problems[:SHOWN]) + more


def judge(doc: dict[str, Any]) -> dict[str, Any]:
    """Each changed key's ``[class, why]``; the model is built only for keys the task's
    ``resume_keys`` leaves undeclared."""
    p = resolve(doc["profile"], SOURCE)
    keys, kind = list(doc["keys"]), p.task_kind
    try:
        task_cls = load_task_class(kind)
        verdicts = declared(task_cls, kind, keys)
    except (TaskLoadError, TaskBuildError) as e:
        return {"error": f"task {kind}: {e}" if isinstance(e, TaskLoadError) else str(e),
                "key": keys[0]}  # fmt: skip
    rest = [k for k in keys if k not in verdicts]
    if rest:
        try:
            built = model_shapes(p, int(doc.get("start_step") or 0))
        except TaskBuildError as e:
            return {"error": str(e), "key": rest[0]}
        try:
            saved = checkpoint_shapes(Path(doc["checkpoint"]))
        except Exception as e:
            why = f"{doc['checkpoint']}: its model cannot be read ({_last_line(e)})"
            return {"error": why, "key": rest[0]}
        problem = mismatch(saved, built)
        verdict = (
            (REFUSED, TASK_DOES_NOT_LOAD.format(problem)) if problem else (WARNING, TASK_LOADS)
        )
        verdicts.update(dict.fromkeys(rest, verdict))
    return {"verdicts": verdicts, "built": bool(rest)}


def main() -> int:
    doc = json.loads(sys.stdin.read())
    try:
        answer = judge(doc)
    except Exception as e:  # a profile the task's Config refuses, an import that raised
        kind = (doc.get("profile", {}).get("task") or {}).get("kind")
        answer = {"error": f"task {kind}: {_last_line(e)}", "key": (doc.get("keys") or [""])[0]}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
