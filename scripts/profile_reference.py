"""Print the profile key reference that docs/profiles.md carries between its REFERENCE markers.

    python scripts/profile_reference.py            # print it
    python scripts/profile_reference.py --write    # rewrite docs/profiles.md's section in place

tests/test_docs.py fails when the page's copy differs, so the two never drift apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpu_console import schema
from gpu_console.profile import SECTIONS
from gpu_console.tasks import BUILTIN

BEGIN, END = "<!-- REFERENCE:BEGIN -->", "<!-- REFERENCE:END -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "profiles.md"


def _table(title: str, prefix: str, cls: type) -> list[str]:
    lines = [f"**{title}**", "", "| key | default | meaning |", "| --- | --- | --- |"]
    for key, _tp, default, meaning in schema.describe(cls):
        shown = schema.show(default) if default != "" else '""'
        lines.append(f"| `{prefix}.{key}` | `{shown}` | {meaning} |")
    return [*lines, ""]


def reference() -> str:
    lines: list[str] = []
    for name, cls in SECTIONS.items():
        lines += _table(f"[{name}]", name, cls)
    for kind, (_path, cls) in BUILTIN.items():
        lines += _table(f'[task] kind = "{kind}"', "task", cls)
    return "\n".join(lines).rstrip() + "\n"


def splice(page: str) -> str:
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{reference()}{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        PAGE.write_text(splice(PAGE.read_text()))
    else:
        sys.stdout.write(reference())
