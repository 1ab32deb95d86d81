"""README and docs/ stay true: README's Quickstart has two commands; docs/profiles.md's key
reference is the schema's; docs/tasks.md documents every task attribute the engine reads."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO


def test_the_key_reference_in_docs_matches_the_schema():
    sys.path.insert(0, str(REPO / "scripts"))
    from profile_reference import BEGIN, END, PAGE, splice

    assert PAGE == REPO / "docs" / "profiles.md"
    text = PAGE.read_text()
    assert BEGIN in text and END in text
    assert splice(text) == text, "run: python scripts/profile_reference.py --write"


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_test_one():
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:sh|bash)?\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    assert "gpu-console run quickstart --headless" in commands[0]
    # A fresh machine's system Python may refuse pip (PEP 668): the first command makes a
    # virtual environment and installs into it.
    steps = [step.strip() for step in commands[0].split("&&")]
    assert steps[0].startswith("python3 -m venv ")
    assert steps[1].startswith(". ") and steps[1].endswith("/bin/activate")
    assert any(step.startswith("pip install torch==") for step in steps[2:])
    assert commands[1] in (REPO / ".ci" / "run").read_text()


def test_help_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import gpu_console.cli"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    assert not re.search(r"\|\s+torch$", out, re.M)
    assert "gpu_console.cli" in out


def task_attributes_the_engine_reads() -> set[str]:
    """Every task method or attribute the engine's code looks up, calls or sets."""
    names: set[str] = set()
    sources = [
        *(REPO / "gpu_console" / "engine").glob("*.py"),
        REPO / "gpu_console/tasks/loader.py",
    ]
    for path in sources:
        src = path.read_text()
        names.update(re.findall(r'(?:getattr|hasattr)\((?:task|task_cls|cls), "(\w+)"', src))
        names.update(re.findall(r"\btask\.(\w+)\s*(?:\(|=[^=])", src))
    return names


def test_the_task_page_documents_everything_the_engine_reads_from_a_task():
    import dataclasses

    from gpu_console.engine.context import TaskContext
    from gpu_console.tasks.base import TaskOutput

    section = (REPO / "docs" / "tasks.md").read_text()
    assert section.startswith("# Your own task\n")
    read = task_attributes_the_engine_reads()
    assert {"compute", "configure_optimizers", "state_dict", "ctx", "Config"} <= read
    fields = {f.name for f in dataclasses.fields(TaskOutput)}
    context = {f.name for f in dataclasses.fields(TaskContext) if not f.name.startswith("_")}
    context |= {"task_dir", "is_main", "log"}
    missing = sorted(n for n in read | fields | context if f"`{n}" not in section)
    assert not missing, f"docs/tasks.md ('Your own task') does not document {missing}"
