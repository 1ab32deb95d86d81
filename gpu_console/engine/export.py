"""``python -m gpu_console.engine.export CHECKPOINT OUT RUN_DIR``: plain ``state_dict``s out.

Run by ``gpu-console export`` in a subprocess (the console never imports torch). The file is
what plain PyTorch loads with ``torch.load(OUT)`` and ``model.load_state_dict(...)``, without
gpu-console installed: CPU tensors, no DDP ``module.`` and no ``torch.compile`` ``_orig_mod.``
prefixes. Its content: the model's state_dict itself, or, where the task declares
``export_modules()`` (``{name: submodule path}``, ``""`` for the whole model), one state_dict
per name. Written to a temporary file beside OUT, fsynced and renamed: never half a file.

On success one JSON line on stdout (what was written); a bad input is one line on stderr and
exit 2, with nothing written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

EXIT_BAD_INPUT = 2


class ExportInputError(Exception):
    """What the export cannot do as asked (a task's export_modules naming no submodule)."""


def plain_keys(state: dict[str, Any]) -> dict[str, Any]:
    """The parameters' names as the bare model has them: compile's ``_orig_mod.`` dropped
    wherever it is (a compiled submodule too), DDP's ``module.`` where every key has it (a
    model of your own may have a submodule named ``module``)."""
    out = {".".join(p for p in k.split(".") if p != "_orig_mod"): v for k, v in state.items()}
    if out and all(k.startswith("module.") for k in out):
        out = {k[len("module.") :]: v for k, v in out.items()}
    return out


def plain_state(model_state: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for key, value in plain_keys(model_state).items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu").clone()  # out of the checkpoint's mapping
        out[key] = value
    return out


def split(state: dict[str, Any], modules: dict[str, str]) -> dict[str, dict[str, Any]]:
    """One state_dict per declared submodule (keys relative to it)."""
    out: dict[str, dict[str, Any]] = {}
    for name, path in modules.items():
        if not isinstance(name, str) or not isinstance(path, str):
            raise ExportInputError(
                f"the task's export_modules() must map names to submodule paths (got {name!r}: "
                f"{path!r})"
            )
        if path == "":
            out[name] = dict(state)
            continue
        prefix = path + "."
        part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not part:
            tops = sorted({k.split(".", 1)[0] for k in state})
            raise ExportInputError(
                f"the task's export_modules(): {name!r} names {path!r}, no submodule with "
                f"weights (the model's top-level modules: {', '.join(tops)})"
            )
        out[name] = part
    return out


def task_modules(run_dir: Path) -> dict[str, str] | None:
    """The task's ``export_modules()``, or None where it declares none."""
    from ..profile import load_profile, with_task_config
    from ..runs import current_session, read_json
    from ..tasks.base import ExportsModules
    from ..tasks.loader import load_task_class

    meta = current_session(read_json(run_dir / "meta.json") or {})
    if meta.get("cwd") and meta["cwd"] not in sys.path:
        sys.path.insert(0, meta["cwd"])  # a user's task module, found as the run found it
    profile = load_profile(str(run_dir / "run.toml"))
    task_cls = load_task_class(profile.task_kind)
    if not hasattr(task_cls, "export_modules"):
        return None
    profile = with_task_config(profile, task_cls.Config, str(run_dir / "run.toml"))
    modules = cast(ExportsModules, task_cls(profile.task)).export_modules()  # it has one
    if not isinstance(modules, dict) or not modules:
        raise ExportInputError(
            f"the task's export_modules() must return a non-empty dict (got {modules!r})"
        )
    return modules


def write_atomic(obj: Any, out: Path) -> int:
    """torch.save to a temporary file beside ``out``, fsync, rename; the file's size."""
    import torch

    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dirfd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
    return out.stat().st_size


def export(checkpoint: Path, out: Path, run_dir: Path) -> dict[str, Any]:
    from ..profile import ProfileError
    from ..tasks.loader import TaskLoadError
    from .checkpoint import load

    try:
        modules = task_modules(run_dir)
    except (ProfileError, TaskLoadError) as e:
        raise ExportInputError(f"{run_dir / 'run.toml'}: {e}") from None
    from .sharded_checkpoint import is_sharded, model_state

    state = load(checkpoint)
    # An FSDP run's model is in its DCP shards, read whole here without a process group.
    weights = plain_state(model_state(checkpoint) if is_sharded(checkpoint) else state["model"])
    step = int(state["step"])
    del state
    content: Any = weights if modules is None else split(weights, modules)
    size = write_atomic(content, out)
    keys = {"": len(weights)} if modules is None else {n: len(sd) for n, sd in content.items()}
    return {"path": str(out), "bytes": size, "step": step, "checkpoint": str(checkpoint),
            "keys": keys}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m gpu_console.engine.export CHECKPOINT OUT RUN_DIR", file=sys.stderr)
        return EXIT_BAD_INPUT
    checkpoint, out, run_dir = (Path(a) for a in argv)
    try:
        written = export(checkpoint, out, run_dir)
    except ExportInputError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
