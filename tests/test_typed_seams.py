"""The typed seams (issue 39) agree with what runs: the strategy's abstract interface is
complete in every strategy, and the task contract's protocols (tasks/base.py) name every
optional method docs/tasks.md lists, with the arguments the built-in and example tasks take.

In-process, no torchrun: these are declarations checked against the code and the docs (the
type checker itself runs in CI, `.ci/run`).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import typing
from pathlib import Path

import pytest

from gpu_console.engine.strategy import Strategy
from gpu_console.engine.strategy_ddp import DdpStrategy
from gpu_console.engine.strategy_expert import ExpertParallelStrategy
from gpu_console.engine.strategy_fsdp import FsdpStrategy
from gpu_console.engine.strategy_single import SingleStrategy
from gpu_console.tasks import BUILTIN, base
from gpu_console.tasks.loader import load_task_class

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

ROOT = Path(__file__).resolve().parent.parent
# Data attributes of the contract (a dict, or a dict or a method), not methods: no protocol.
ATTRIBUTES = {"Config", "ctx", "metric_reduce", "derived_metrics", "resume_keys"}
REQUIRED = {"__init__", "build_model", "build_datasets", "compute"}


def _protocols() -> dict[str, type]:
    return {
        name: cls
        for name, cls in vars(base).items()
        if isinstance(cls, type) and typing.Protocol in cls.__mro__[1:] and cls is not base.Task
    }


def _hook_methods() -> dict[str, inspect.Signature]:
    """Each optional method's signature, as its protocol declares it."""
    out = {}
    for cls in _protocols().values():
        for name, fn in vars(cls).items():
            if inspect.isfunction(fn) and not name.startswith("_"):
                out[name] = inspect.signature(fn)
    return out


def test_every_strategy_provides_what_the_interface_names():
    with pytest.raises(TypeError, match="abstract"):
        Strategy()  # type: ignore[abstract]
    assert {"make_scaler", "wrap", "clip", "gradient_reduce", "save", "start_fields"} <= set(
        Strategy.__abstractmethods__
    )
    for cls in (DdpStrategy, FsdpStrategy, SingleStrategy, ExpertParallelStrategy):
        assert not cls.__abstractmethods__, (cls.__name__, cls.__abstractmethods__)


def test_every_optional_method_of_the_task_contract_has_a_protocol():
    text = (ROOT / "docs" / "tasks.md").read_text(encoding="utf-8")
    start = text.index("| `Config` |")
    table = text[start : text.index("\n\n", start)]
    named = set()
    for row in table.splitlines():
        first = row.split("|")[1]
        named |= set(re.findall(r"`([A-Za-z_]+)", first))
    optional = named - ATTRIBUTES - REQUIRED
    assert "on_eval_end" in optional and "train_step" in optional  # the table was read
    missing = optional - set(_hook_methods())
    assert not missing, f"docs/tasks.md names hooks without a protocol in tasks/base.py: {missing}"
    assert set(vars(base.Task)) >= REQUIRED


def _task_classes() -> list[type]:
    classes = [load_task_class(kind) for kind in sorted(BUILTIN) if kind != "hf"]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        for name in ("char_lstm", "gan", "gpt_char", "sine_task"):
            module = importlib.import_module(name)
            classes += [
                c
                for c in vars(module).values()
                if isinstance(c, type) and c.__module__ == name and hasattr(c, "build_model")
            ]
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return classes


def test_the_tasks_hooks_take_what_their_protocols_declare():
    hooks = _hook_methods()
    seen = set()
    for cls in _task_classes():
        for name, declared in hooks.items():
            fn = getattr(cls, name, None)
            if fn is None or not callable(fn):
                continue
            seen.add(name)
            theirs = [p.name for p in inspect.signature(fn).parameters.values()][1:]
            ours = [p.name for p in declared.parameters.values()][1:]
            assert len(theirs) == len(ours), (cls.__name__, name, theirs, ours)
    # The check reached the built-ins' and examples' own hooks, not just an empty set.
    assert {"on_eval_end", "state_dict", "configure_optimizers", "blocks"} <= seen, seen
