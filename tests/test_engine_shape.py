"""The engine's shape, as issue 21 set it: a trainer that reads top to bottom, short
functions, no closures over the loop's state, no branch on the strategy or the update step
in the trainer, and no import circle among the engine's modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

ENGINE = Path(__file__).resolve().parent.parent / "gpu_console" / "engine"
LONGEST = 80
# The trainer and the parts it calls: none holds a nested def (a closure over their state).
PARTS = (
    "trainer.py", "build.py", "checkpointer.py", "step_log.py", "update_step.py",
    "task_step.py", "control_handler.py", "evaluate.py", "nan_stop.py", "cadence.py",
    "strategy.py", "strategy_ddp.py", "strategy_fsdp.py", "start_event.py", "loop.py",
)  # fmt: skip


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def lines(node) -> int:
    """From ``def`` to the function's last line."""
    return node.end_lineno - node.lineno + 1


def test_no_engine_function_is_longer_than_80_lines():
    long = [
        f"{path.name}:{fn.lineno} {fn.name} ({lines(fn)} lines)"
        for path in sorted(ENGINE.glob("*.py"))
        for fn in functions(path)
        if lines(fn) > LONGEST
    ]
    assert not long, f"longer than {LONGEST} lines: {long}"


def test_the_trainers_run_method_is_short_and_in_order():
    tree = ast.parse((ENGINE / "trainer.py").read_text(encoding="utf-8"))
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    (run,) = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    assert lines(run) <= LONGEST
    # build (and resume), then per step: update, log, evaluate, checkpoint, control; the end
    body = ast.get_source_segment((ENGINE / "trainer.py").read_text(encoding="utf-8"), run)
    order = ["build(", ".update.run(", "self.log(", ".evaluator.run(", ".checkpointer.save(",
             ".control.obey(", "self.end()"]  # fmt: skip
    at = 0
    for call in order:
        found = body.find(call, at)
        assert found >= 0, f"{call} not after {body[:at][-60:]!r}"
        at = found + len(call)


def test_the_trainer_never_branches_on_the_strategy_or_the_update_step():
    text = (ENGINE / "trainer.py").read_text(encoding="utf-8")
    assert not re.search(r"sharded|owned", text)
    assert not re.search(r"isinstance\(|\.name ==|fsdp|ddp", text, re.I)


def test_the_trainers_parts_hold_no_closures():
    nested = []
    for name in PARTS:
        for fn in functions(ENGINE / name):
            inner = [n for n in ast.walk(fn) if n is not fn and isinstance(n, ast.FunctionDef)]
            nested += [f"{name}: {n.name} in {fn.name}" for n in inner]
    assert not nested, nested


def _imports(path: Path) -> set[str]:
    """The engine modules ``path`` imports at module level (lazy imports in functions are
    a module's own business: they cannot make a circle at import time)."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return {m for m in found if (ENGINE / f"{m}.py").exists()}


def test_no_import_circle_among_the_engines_modules():
    graph = {p.stem: _imports(p) for p in ENGINE.glob("*.py")}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " → ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
