"""Import a task class by name or import path, and check it has what the engine calls."""

from __future__ import annotations

import dataclasses
import importlib

from . import import_target


class TaskLoadError(Exception):
    """A task import path that cannot be imported or is not a task."""


def load_task_class(kind: str) -> type:
    module_name, _, attr = import_target(kind).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskLoadError(
            f"task.kind: cannot import {module_name!r} ({e}) (got {kind!r})"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskLoadError(f"task.kind: {module_name!r} has no {attr!r} (got {kind!r})")
    missing = [m for m in ("build_model", "build_datasets", "compute") if not hasattr(cls, m)]
    config = getattr(cls, "Config", None)
    if missing:
        raise TaskLoadError(f"task.kind: {kind} lacks {', '.join(missing)} (got {kind!r})")
    if config is None or not dataclasses.is_dataclass(config):
        raise TaskLoadError(f"task.kind: {kind}.Config must be a dataclass (got {kind!r})")
    return cls
