"""``gpu-console --runs-dir DIR COMMAND``: the runs directory given before the command is the
one every command uses (its own ``--runs-dir`` first, then this one, then $GPU_CONSOLE_RUNS,
then ./runs); the two flags naming different directories is one line, exit 2.

Through the real CLI in a subprocess, on synthetic run directories (no training): one run in
the directory the option names, another in ./runs and in $GPU_CONSOLE_RUNS, so a command that
reads the wrong one shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import synthetic
from conftest import test_env as cli_env

from gpu_console.runs import EXIT_BAD_INPUT


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """Three runs directories, each with one finished run named after it; the cwd is
    ``tmp_path``, whose ./runs is one of them."""
    dirs = {
        "chosen": tmp_path / "elsewhere",
        "default": tmp_path / "runs",
        "env": tmp_path / "from-env",
    }
    for name, folder in dirs.items():
        synthetic.write_run(folder / f"{name}-20261129-120000", steps=20)
    return dirs


def names(done) -> list[str]:
    assert done.returncode == 0, done.stderr
    return [row["name"] for row in json.loads(done.stdout)]


@pytest.mark.parametrize("env", [False, True], ids=["no-env", "env-set"])
def test_ls_before_the_command_lists_that_directory(procs, places, tmp_path, env):
    extra = {"GPU_CONSOLE_RUNS": str(places["env"])} if env else {}
    done = procs.cli("--runs-dir", str(places["chosen"]), "ls", "--json", cwd=tmp_path,
                     env=cli_env(**extra))  # fmt: skip
    assert names(done) == ["chosen-20261129-120000"]


def test_precedence_without_the_group_option_is_unchanged(procs, places, tmp_path):
    env = cli_env(GPU_CONSOLE_RUNS=str(places["env"]))
    assert names(procs.cli("ls", "--json", cwd=tmp_path, env=env)) == ["env-20261129-120000"]
    assert names(procs.cli("ls", "--json", cwd=tmp_path)) == ["default-20261129-120000"]
    own = procs.cli("ls", "--json", "--runs-dir", str(places["chosen"]), cwd=tmp_path, env=env)
    assert names(own) == ["chosen-20261129-120000"]


def test_status_before_the_command_finds_the_run_there(procs, places, tmp_path):
    done = procs.cli("--runs-dir", str(places["chosen"]), "status", "chosen", "--json",
                     cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "chosen-20261129-120000"
    # A run that is only in ./runs is not found there: the option is not a fallback.
    missing = procs.cli("--runs-dir", str(places["chosen"]), "status", "default", cwd=tmp_path)
    assert missing.returncode == EXIT_BAD_INPUT, missing.stderr
    assert str(places["chosen"]) in missing.stderr


def test_attach_before_the_command_looks_there(procs, tmp_path):
    """attach opens a TUI on a run; an empty directory named before the command is refused
    by name (./runs has a run it would otherwise open)."""
    synthetic.write_run(tmp_path / "runs" / "default-20261129-120000", steps=20)
    empty = tmp_path / "empty"
    empty.mkdir()
    done = procs.cli("--runs-dir", str(empty), "attach", cwd=tmp_path)
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.strip() == f"gpu-console: {empty}: no runs to attach to"


def test_dry_run_plans_the_run_in_that_directory(procs, tmp_path):
    chosen = tmp_path / "elsewhere"
    done = procs.cli("--runs-dir", str(chosen), "run", "quickstart", "--dry-run", "--json",
                     "--no-step", cwd=tmp_path, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert Path(plan["run_dir"]).parent == chosen
    assert Path(plan["run_dir"]).name.startswith("quickstart-")
    assert plan["creates_run_dir"] is True
    assert not chosen.exists() and not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize(
    "command",
    [["ls"], ["status", "chosen"], ["run", "quickstart", "--dry-run", "--no-step"]],
    ids=["ls", "status", "run"],
)
def test_two_different_runs_dirs_are_refused(procs, places, tmp_path, command):
    """Both flags naming different places: one line, exit 2, before anything is read or
    written (the run is refused before its profile is even looked at; a dry run, so that
    without the refusal nothing would start either)."""
    other = tmp_path / "other"
    done = procs.cli("--runs-dir", str(places["chosen"]), *command, "--runs-dir", str(other),
                     cwd=tmp_path)  # fmt: skip
    assert done.returncode == EXIT_BAD_INPUT, done.stdout
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"gpu-console: --runs-dir given twice: {places['chosen']} before the command and "
        f"{other} after it; give one"
    ]
    assert not other.exists()


def test_the_same_directory_twice_is_that_directory(procs, places, tmp_path):
    done = procs.cli("--runs-dir", "elsewhere", "ls", "--json",
                     "--runs-dir", str(places["chosen"]) + "/", cwd=tmp_path)  # fmt: skip
    assert names(done) == ["chosen-20261129-120000"]


def test_a_run_after_the_groups_options_holds_the_schedulers_signals_from_its_first_line():
    # entry.py holds SIGTERM and SIGUSR1 for `run` before anything is imported (issue 43); the
    # group's --runs-dir before the command must not hide that it is a run.
    from gpu_console.entry import command_of

    assert command_of(["run", "quickstart"]) == "run"
    assert command_of(["--runs-dir", "elsewhere", "run", "quickstart"]) == "run"
    assert command_of(["--runs-dir=elsewhere", "run"]) == "run"
    assert command_of(["--runs-dir", "run", "ls"]) == "ls"  # a directory named run
    assert command_of(["ls", "--profile", "run"]) == "ls"
    assert command_of(["--version"]) is None
    assert command_of([]) is None
