"""Import a task class by name or import path, and check it has what the engine calls."""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from . import import_target

if TYPE_CHECKING:
    from .base import Task


class TaskLoadError(Exception):
    """A task import path that cannot be imported or is not a task."""


def load_task_class(kind: str) -> type[Task]:
    module_name, _, attr = import_target(kind).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskLoadError(
            f"task.kind: cannot import {module_name!r} ({e}) (got {kind!r})"
        ) from None
    except SyntaxError as e:  # the user's file and line, as Python would point at them
        where = f"{e.filename}:{e.lineno}" if e.filename else module_name
        raise TaskLoadError(f"task.kind: {where}: {e.msg} (got {kind!r})") from None
    except Exception as e:  # the module's own code raised while it was imported
        raise TaskLoadError(
            f"task.kind: importing {module_name!r} failed at {_where(e)}: "
            f"{type(e).__name__}: {e} (got {kind!r})"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskLoadError(f"task.kind: {module_name!r} has no {attr!r} (got {kind!r})")
    missing = [m for m in ("build_model", "build_datasets") if not hasattr(cls, m)]
    if not hasattr(cls, "compute") and not hasattr(cls, "train_step"):
        missing.append("compute (or train_step)")
    config = getattr(cls, "Config", None)
    if missing:
        raise TaskLoadError(f"task.kind: {kind} lacks {', '.join(missing)} (got {kind!r})")
    if config is None or not dataclasses.is_dataclass(config):
        raise TaskLoadError(f"task.kind: {kind}.Config must be a dataclass (got {kind!r})")
    return cls


def _where(e: BaseException) -> str:
    """``file:line`` of the innermost frame of an exception's traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else "?"
