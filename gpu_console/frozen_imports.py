"""Imports made with Python's cyclic garbage collector off, then frozen out of its reach.

Importing torch makes some hundred thousand long-lived objects, and each collection that
allocation triggers walks all of them made so far: about a fifth of a process's import CPU
(a rank's, torchrun's). Frozen (``gc.freeze``), they are not walked by later collections
either, the training steps' among them. Only what exists when the block ends is frozen; what
is imported later (a user's task module) is collected as usual. No torch here: torchrun's
wrapper (quick_exit.py) uses it too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
