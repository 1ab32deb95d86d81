"""ls / stop / checkpoint from another shell, against a live run and an ended one."""

from __future__ import annotations

import json
import os
import shutil
import signal
from types import SimpleNamespace

import pytest
from conftest import (
    Procs,
    deadline,
    events_of,
    fast_profile,
    pinned_env,
    read_status,
    the_run,
    wait_for,
)


def _live(procs, runs_dir, tmp_path, *args, env=None):
    profile = fast_profile(tmp_path, max_steps=1_000_000)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir), *args,
                          env=env)  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a first step")
    # The supervisor folds events into status.json on its own tick, a moment later.
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")
    return console, run


@pytest.fixture(scope="module")
def nightly(tmp_path_factory):
    """A live run launched as ``--name nightly.v2 --exact-name`` (one CPU rank), then ``ls``,
    ``checkpoint`` and ``stop`` from another shell while it lives, and a ``stop`` after its
    end: what each command returned, for the tests to read. Read it, never change it."""
    tmp = tmp_path_factory.mktemp("nightly")
    runs_dir = tmp / "runs"
    procs = Procs(runs_dir)
    env = pinned_env()
    rd = ["--runs-dir", str(runs_dir)]

    def cli(*args):
        return procs.cli(*args, env=env)

    try:
        console, run = _live(procs, runs_dir, tmp, "--name", "nightly.v2", "--exact-name", env=env)
        got = SimpleNamespace(runs_dir=runs_dir, run=run, console=console)
        got.live_rows = cli("ls", "--json", *rd)
        got.live_table = cli("ls", *rd)
        got.checkpoint = cli("checkpoint", run.name, *rd)  # by name, not path
        got.requested = [c for c in events_of(run, "checkpoint") if c["reason"] == "request"]
        got.stop = cli("stop", str(run), *rd)
        got.out, got.err = console.communicate(timeout=deadline(120))
        got.status = read_status(run)
        got.ended_rows = cli("ls", "--json", *rd)
        got.stop_again = cli("stop", run.name, *rd)
        yield got
    finally:
        procs.cleanup()


def test_ls_checkpoint_and_stop_from_another_shell(nightly):
    run = nightly.run

    rows = json.loads(nightly.live_rows.stdout)
    assert [(r["name"], r["state"]) for r in rows] == [(run.name, "running")]
    table = nightly.live_table.stdout
    assert run.name in table and "running" in table

    done = nightly.checkpoint
    assert done.returncode == 0, done.stderr
    requested = nightly.requested
    assert len(requested) == 1 and requested[0]["path"] in done.stdout

    stopped = nightly.stop
    assert stopped.returncode == 0, stopped.stderr
    assert "stopping with a checkpoint" in stopped.stdout
    assert nightly.console.returncode == 0, nightly.out + nightly.err
    assert nightly.status["state"] == "stopped"

    rows = json.loads(nightly.ended_rows.stdout)
    assert rows[0]["state"] == "stopped" and rows[0]["step"] >= requested[0]["step"]

    # A command to an ended run is a bad input: exit 2, one line.
    again = nightly.stop_again
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"gpu-console: {run}: the run has already ended (state stopped)"
    ]


def test_a_run_whose_supervisor_is_gone_is_lost_not_running(procs, runs_dir, tmp_path):
    console, run = _live(procs, runs_dir, tmp_path)
    os.kill(read_status(run)["pids"]["supervisor"], signal.SIGKILL)
    wait_for(
        lambda: (
            json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)[0]["state"]
            == "lost"
        ),
        what="ls to say lost",
    )
    assert procs.cli("checkpoint", run.name, "--runs-dir", str(runs_dir)).returncode == 2


def test_ls_with_no_runs_and_an_unknown_run(procs, runs_dir):
    assert "no runs under" in procs.cli("ls", "--runs-dir", str(runs_dir)).stdout
    bad = procs.cli("stop", "ghost", "--runs-dir", str(runs_dir))
    assert bad.returncode == 2
    assert bad.stderr.startswith("gpu-console: ghost: no such run")


def test_exact_name_makes_the_run_directory_exactly_that_and_never_reuses_one(
    procs, tmp_path, nightly
):
    from conftest import fast_profile

    # The module's run, launched with --name nightly.v2 --exact-name (ended by a stop).
    assert nightly.console.returncode == 0, nightly.out + nightly.err
    assert [p.name for p in nightly.runs_dir.iterdir()] == ["nightly.v2"]
    assert (nightly.runs_dir / "nightly.v2" / "run.toml").is_file()
    runs = tmp_path / "runs"  # a copy, for the refusals below to meet
    runs.mkdir()
    shutil.copytree(nightly.run, runs / "nightly.v2", symlinks=True)
    profile = fast_profile(tmp_path, max_steps=3)
    before = sorted(str(p) for p in runs.rglob("*"))

    def refused(*args: str) -> str:
        result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs), *args)
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        return line

    again = refused("--name", "nightly.v2", "--exact-name")
    assert again == (
        f"gpu-console: --name: {runs / 'nightly.v2'} already exists; --exact-name never reuses "
        "a directory (continue it with --resume nightly.v2, or pick another name)"
    )
    assert (
        refused("--exact-name") == "gpu-console: --exact-name: give the run's name with --name NAME"
    )
    assert refused("--name", "a b", "--exact-name").startswith(
        "gpu-console: --name: 'a b' is not a run directory name as it stands"
    )
    assert sorted(str(p) for p in runs.rglob("*")) == before  # nothing written
