"""ARCHITECTURE.md is the newcomer's map: every module of the package is on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpu_console"


def mapped() -> set[str]:
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    _, _, code_map = text.partition("## Code map")
    code_map, _, _ = code_map.partition("\n## ")
    return set(re.findall(r"^- `(gpu_console/[\w/]+(?:\.py|/))`", code_map, re.M))


def modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        # A package is mapped by its folder (its __init__ is what the folder line says),
        # except the top one, whose __init__ carries the version.
        if path.name == "__init__.py" and path.parent != PACKAGE:
            found.add(path.parent.relative_to(REPO).as_posix() + "/")
        else:
            found.add(rel)
    return found


def test_every_module_is_on_the_code_map():
    missing = sorted(modules() - mapped())
    assert not missing, f"ARCHITECTURE.md's code map lacks: {', '.join(missing)}"


def test_the_code_map_names_no_module_that_is_gone():
    gone = sorted(mapped() - modules())
    assert not gone, f"ARCHITECTURE.md's code map names modules that do not exist: {gone}"
