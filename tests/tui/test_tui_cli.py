"""The console's commands off a terminal: what they say, and that nothing imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


def test_attach_with_no_run_is_a_bad_input(procs, runs_dir):
    result = procs.cli("attach", "--runs-dir", str(runs_dir / "empty"))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("no runs to attach to")
    assert "Traceback" not in result.stderr
    result = procs.cli("attach", "nope", "--runs-dir", str(runs_dir))
    assert result.returncode == 2 and "nope: no such run" in result.stderr


def test_attach_help_offers_read_only(procs):
    result = procs.cli("attach", "--help")
    assert result.returncode == 0 and "--readonly" in result.stdout


def test_without_a_terminal_the_bare_command_prints_help(procs):
    result = procs.cli()
    assert result.returncode == 0 and "needs a terminal" in result.stdout


def test_the_console_never_imports_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import gpu_console.tui.app"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "textual.app" in imported and not any(m.split(".")[0] == "torch" for m in imported)
