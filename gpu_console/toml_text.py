"""TOML read the same way everywhere: ``tomllib`` on Python 3.11+, ``tomli`` before it.

The one place that knows which of the two is installed. No torch here.
"""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOMLDecodeError = tomllib.TOMLDecodeError


def loads(text: str) -> dict[str, Any]:
    """The document; :class:`TOMLDecodeError` where it does not parse."""
    return tomllib.loads(text)


def loads_or_empty(text: str) -> dict[str, Any]:
    """The document, or ``{}`` where it does not parse: for readers of a run.toml the launch
    already validated, which fall back to the defaults rather than fail a running run."""
    try:
        return tomllib.loads(text)
    except ValueError:  # TOMLDecodeError is one
        return {}
