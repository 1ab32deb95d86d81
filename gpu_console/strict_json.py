"""Strict JSON for every file and ``--json`` output the project writes (no torch here).

Python's ``json`` writes a non-finite float as the bare tokens ``NaN``/``Infinity``, which are
not JSON: strict parsers (JavaScript's ``JSON.parse``, jq, most other languages) reject the
whole line. A NaN loss is exactly what a run reports when training goes wrong, so the value
is written as ``null`` with a sibling flag naming it::

    {"loss": NaN}  ->  {"loss": null, "loss_nonfinite": "nan"}   ("nan", "inf" or "-inf")

In a list (no key to hang a flag on) a non-finite number is only ``null``. :func:`revive`
undoes the flags where the project reads its own files, so every reader in memory sees the
float it saw before (and shows ``nan`` to the user) without knowing about the scheme.
:func:`dumps` encodes with ``allow_nan=False``: a value this module missed fails loudly.
"""

from __future__ import annotations

import json
import math
from typing import Any

FLAG = "_nonfinite"
_FLAG_TEXT = FLAG + '"'
_FLAG_BYTES = _FLAG_TEXT.encode()
_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _name(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def encode(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced (see the module's doc); others as is."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
                out[f"{k}{FLAG}"] = _name(v)
            else:
                out[k] = encode(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` that writes strict JSON (``kw``: indent, separators, sort_keys...).

    Most documents hold no non-finite number: they are written by the C encoder as they are,
    and only one it refuses is walked in Python (an engine's step event, issue 26)."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(encode(obj), allow_nan=False, **kw)


def revive(obj: Any) -> Any:
    """The flags of :func:`encode` turned back into floats (in place for dicts)."""
    if isinstance(obj, dict):
        for k in [k for k in obj if isinstance(k, str) and k.endswith(FLAG)]:
            base = k[: -len(FLAG)]
            if obj.get(base) is None and obj[k] in _NAMES:
                obj[base] = _NAMES[obj.pop(k)]
        for v in obj.values():
            if isinstance(v, (dict, list)):
                revive(v)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)):
                revive(v)
    return obj


def loads(data: str | bytes) -> Any:
    """Parse a line or document the project wrote, flags revived (skipped where absent:
    the events of a long run are parsed line by line, most without a flag)."""
    obj = json.loads(data)
    flagged = (_FLAG_BYTES in data) if isinstance(data, bytes) else (_FLAG_TEXT in data)
    return revive(obj) if flagged else obj
