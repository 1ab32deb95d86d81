"""README and docs/ stay true: README is a front door of two Quickstart commands that links
every page; docs/profiles.md's key reference is the schema's; docs/tasks.md documents every
task attribute the engine reads; every relative link lands on a file and a heading."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


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


DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")


def test_readme_is_a_front_door_that_links_every_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "](docs/README.md)" in text
    index = (DOCS / "README.md").read_text()
    for page in PAGES:
        assert f"](docs/{page.name}" in text, f"README does not link docs/{page.name}"
        assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"
    assert text.count("](screenshots/") == 1, "README shows one screenshot"


def _prose(text: str) -> str:
    """The text without fenced code blocks, inline code shown as a placeholder word."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]+`", "code", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    heading = heading.strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M):
        slug, n = _slug(heading), 1
        while slug in found:  # GitHub numbers a repeated heading's anchor
            slug, n = f"{_slug(heading)}-{n}", n + 1
        found.add(slug)
    return found


def test_slugs_follow_githubs_rules():
    assert _slug("FSDP: a model sharded over the ranks") == "fsdp-a-model-sharded-over-the-ranks"
    assert _slug("What a resume does with changes") == "what-a-resume-does-with-changes"
    assert _slug("`train_step` and `TaskOutput`") == "train_step-and-taskoutput"


LINKED = [
    REPO / "README.md",
    REPO / "ARCHITECTURE.md",
    REPO / "tests" / "README.md",
    REPO / "benchmarks" / "README.md",
    DOCS / "README.md",
    *PAGES,
]


def test_every_relative_link_lands_on_a_file_and_a_heading():
    assert len(PAGES) >= 8
    broken = []
    for page in LINKED:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{where}: no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_references_to_a_page_in_the_code_and_the_key_reference_exist():
    """A reference such as "(docs/performance.md: Compile)" in a message or a key's meaning
    names a page that exists and, after the colon, one of its headings (or a paragraph's bold
    lead, as "**Data order.**" in docs/tasks.md); nothing points at README's moved sections."""
    sources = [*(REPO / "gpu_console").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    text = "\n".join(p.read_text() for p in [*sources, DOCS / "profiles.md"])
    assert "(README: " not in text
    refs = re.findall(r"docs/([\w-]+\.md)(?:: ([A-Za-z][\w ]*?))?[);]", text)
    assert refs
    for page, heading in refs:
        assert (DOCS / page).exists(), page
        if heading:
            lead = f"**{heading}.**" in (DOCS / page).read_text()
            assert lead or _slug(heading) in anchors(DOCS / page), f"docs/{page}: {heading}"
