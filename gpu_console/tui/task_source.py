"""What the console can tell of a user task without importing it (no torch, no Textual).

A user task's module may import torch at its top, and the console never does; its source
is found on the path a launch would import it from (the working directory first) and read
as text. Only what the text says for certain is taken: a ``def configure_optimizers`` means
the task builds its own optimizers (``train.lr`` unused); its absence proves nothing (a base
class elsewhere may define it).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..tasks import BUILTIN, is_import_path

_OWN_OPTIMIZERS = re.compile(r"^\s*def\s+configure_optimizers\s*\(", re.MULTILINE)


def source_of(kind: str, path: list[str] | None = None) -> Path | None:
    """The file of a ``pkg.mod:Class`` task's module, where it is a plain file on the path."""
    if not is_import_path(kind):
        return None
    parts = kind.partition(":")[0].split(".")
    for entry in path if path is not None else [os.getcwd(), *sys.path]:
        base = Path(entry or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def uses_train_lr(kind: str) -> bool | None:
    """True for a built-in task (each takes train.lr), False for a task whose module defines
    ``configure_optimizers``, None where the console cannot tell."""
    if kind in BUILTIN:
        return True
    source = source_of(kind)
    if source is None:
        return None
    try:
        text = source.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return False if _OWN_OPTIMIZERS.search(text) else None
