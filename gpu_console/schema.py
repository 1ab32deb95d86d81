"""Typed config sections built from plain dicts, with every problem collected.

A section is a dataclass whose fields are declared with :func:`opt`, which carries the
one-line meaning and the constraints. :func:`build` turns a TOML table into the dataclass
and reports each wrong key as ``section.key: what is wrong (got VALUE)``. No torch here:
the console validates profiles, and the console never imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin


class KeyProblem(ValueError):
    """A key's value refused where it is judged against more than itself (a file it names,
    the machine): the launch blames it on its origin as any other (``launch.prepare``)."""

    def __init__(self, key: str, why: str, value: Any):
        super().__init__(f"{key}: {why} (got {show(value)})")
        self.key, self.why, self.value = key, why, value


def opt(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A config field: its default, its one-line meaning, and its limits."""
    meta = {"help": help, "min": min, "max": max, "gt": gt, "check": check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def show(value: Any) -> str:
    """A value as a person typed it, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal and len(get_args(tp)) == 1:
        return show(get_args(tp)[0])
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(show(a) for a in get_args(tp))
    if get_origin(tp) in (list, typing.List):  # noqa: UP006
        item = _type_name(get_args(tp)[0]).removeprefix("an ").removeprefix("a ")
        return "a list of " + item + "s"
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if tp is dict or get_origin(tp) is dict:
        return "a table"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def coerce(tp: Any, value: Any) -> tuple[Any, str | None]:
    """Check ``value`` against type ``tp``; return (value, None) or (None, problem)."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value, None
        return None, f"expected {_type_name(tp)}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None, None  # an optional key left at None (its default): TOML has no null
        problems = []
        for arm in get_args(tp):
            if arm is type(None):
                continue
            got, problem = coerce(arm, value)
            if problem is None:
                return got, None
            problems.append(_type_name(arm))
        return None, "expected " + " or ".join(problems)
    if origin is list:
        if not isinstance(value, list):
            return None, f"expected {_type_name(tp)}"
        out = []
        for item in value:
            got, problem = coerce(get_args(tp)[0], item)
            if problem:
                finite = " (finite)" if problem.endswith("finite number") else ""
                return None, f"expected {_type_name(tp)}{finite}"
            out.append(got)
        return out, None
    if tp is dict or origin is dict:
        # A table handed on as it is (a third party's config): its keys must be names.
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value), None
        return None, "expected a table"
    if tp is bool:
        return (value, None) if isinstance(value, bool) else (None, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return None, "expected an integer"
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None, "expected a number"
        try:
            number = float(value)
        except OverflowError:  # an integer beyond a float's range
            number = math.inf
        # TOML reads inf and nan: an lr of inf passes every limit and fails at step 2.
        if not math.isfinite(number):
            return None, "expected a finite number"
        return number, None
    if tp is str:
        return (value, None) if isinstance(value, str) else (None, "expected a string")
    raise TypeError(f"unsupported config type {tp!r}")


# TOML's integers are 64-bit (a reader may refuse run.toml past them), as are the seeds,
# counts and sizes torch takes: a float like 1e30 given for an integer key stops here.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _limits(meta: dict[str, Any], value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        if value > INT_MAX and meta.get("max") is None:
            return f"must be at most {INT_MAX} (a 64-bit integer)"
        if value < INT_MIN and meta.get("min") is None:
            return f"must be at least {INT_MIN} (a 64-bit integer)"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if meta.get("min") is not None and value < meta["min"]:
            return f"must be at least {show(meta['min'])}"
        if meta.get("gt") is not None and value <= meta["gt"]:
            return f"must be greater than {show(meta['gt'])}"
        if meta.get("max") is not None and value > meta["max"]:
            return f"must be at most {show(meta['max'])}"
    if meta.get("check") is not None:
        return meta["check"](value)
    return None


def build(cls: type, data: dict[str, Any], prefix: str, errors: list[str]) -> Any:
    """Build dataclass ``cls`` from ``data``; append ``prefix.key: problem (got v)`` to errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            near = _near(key, fields)
            hint = f"; did you mean '{near}'?" if near else ""
            errors.append(f"{prefix}.{key}: unknown key{hint} (got {show(value)})")
            continue
        got, problem = coerce(hints[key], value)
        if problem is None:
            problem = _limits(dict(fields[key].metadata), got)
        if problem:
            errors.append(f"{prefix}.{key}: {problem} (got {show(value)})")
            continue
        kwargs[key] = got
    return cls(**kwargs)


def _near(key: str, options: Any) -> str | None:
    import difflib

    hits = difflib.get_close_matches(key, list(options), n=1, cutoff=0.7)
    return hits[0] if hits else None


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, meaning) for each field: the documentation of a section."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # a key without a default (none of the sections has one)
            default = None
        rows.append((f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows


def to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
