"""The built-in text tasks' data (``lm``, ``moe``, ``hf``), judged and counted without torch.

The console refuses a ``task.text_file`` the ranks could not read, and counts the training
sequences a text holds with the same functions the ranks cut it with (:func:`split`), so
``data.batch_size`` is judged before launch with no subprocess (launch.check_data): a busy
machine cannot turn a bad input into a rank's traceback.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..schema import KeyProblem


def text_path(text_file: str, cwd: str | None = None) -> Path:
    """Where ``task.text_file`` points for a rank, which runs in the run's launch directory
    (``cwd``; None: this process's own)."""
    path = Path(text_file).expanduser()
    return path if path.is_absolute() or cwd is None else Path(cwd) / path


def text_size(text_file: str, cwd: str | None = None) -> int:
    """The bytes of ``task.text_file`` (a rank reads them whole), or KeyProblem naming it:
    missing, not a regular file, unreadable or empty."""
    path = text_path(text_file, cwd)

    def refuse(why: str) -> KeyProblem:
        return KeyProblem("task.text_file", why, text_file)

    try:
        if not path.exists():
            raise refuse(f"no such file: {path.absolute()}")
        if not path.is_file():
            raise refuse(f"not a regular file: {path.absolute()}")
        with path.open("rb") as text:  # opened, not judged by its mode bits (root, ACLs)
            if not text.read(1):
                raise refuse(f"the file is empty: {path.absolute()}")
            return os.fstat(text.fileno()).st_size
    except OSError as e:
        raise refuse(f"cannot read {path.absolute()}: {e.strerror or e}") from None


@functools.cache
def help_topics() -> bytes:
    """Python's help topics (``pydoc_data``, shipped with CPython): the text when none is given."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode()


def read_text(c) -> bytes:
    """A rank's text: ``c.text_file``'s bytes (from the rank's own directory), else
    :func:`help_topics`."""
    if not c.text_file:
        return help_topics()
    path = text_path(c.text_file)
    if not path.exists():
        raise FileNotFoundError(f"task.text_file: no such file: {path.resolve()}")
    if not path.is_file():
        raise IsADirectoryError(f"task.text_file: not a regular file: {path.resolve()}")
    return path.read_bytes()


def held_out(n: int, eval_fraction: float) -> int:
    """Tokens at the text's end held out for eval."""
    return int(n * eval_fraction)


def split(n: int, length: int, eval_fraction: float) -> tuple[int, int]:
    """A text of ``n`` tokens cut as the ranks cut it: (training windows of ``length``
    tokens from its start, tokens held out at its end)."""
    held = held_out(n, eval_fraction)
    return (n - held) // length, held


def train_windows(c, length: int, cwd: str | None) -> int:
    """The training windows of ``length`` bytes in ``c``'s text (``c.text_file``, or the help
    topics), or KeyProblem where there is none; nothing is read but the file's size."""
    n = text_size(c.text_file, cwd) if c.text_file else len(help_topics())
    count, _ = split(n, length, c.eval_fraction)
    if count == 0:
        key, value = ("task.text_file", c.text_file) if c.text_file else ("task.seq_len", c.seq_len)
        held = f" (task.eval_fraction = {c.eval_fraction:g} held out)" if c.eval_fraction else ""
        why = f"{n:,} bytes{held} hold no training sequence of {length} bytes"
        raise KeyProblem(key, why, value)
    return count
