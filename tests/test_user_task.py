"""A task of the user's own, by import path, through the real CLI from the repo root.

Its launch checks (the keys, the data count, their time limit, what the task's own
processes leave behind) are the console's: through the real CLI. That the example task then
trains is the engine's (tests/harness.py); one finished launch of a counted task is shared by
the tests that read it (``counted``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
from conftest import REPO, Procs, events_of, only_run, pinned_env, run_dirs, task_profile
from harness import run_engine


def test_example_user_task_trains_from_its_import_path(tmp_path):
    # The engine's part, launched from the repo root as a user would (the task's import path
    # resolved there): the launch's key check of it through the CLI is the next test's.
    run = run_engine(tmp_path, "sine", "train.max_steps=120", cwd=REPO)
    assert events_of(run, "start")[0]["task"] == "examples.sine_task:SineTask"
    steps = events_of(run, "step")
    assert steps[-1]["step"] == 120
    assert steps[-1]["loss_avg"] < 0.5 * steps[0]["loss"]
    assert "hidden = 64" in (run / "run.toml").read_text()  # the user's keys are resolved too
    assert events_of(run, "status")[-1]["state"] == "finished"


def test_user_task_keys_are_checked_against_its_config(procs, runs_dir):
    result = procs.cli(
        "run",
        "sine",
        "--headless",
        "--runs-dir",
        str(runs_dir),
        "--set",
        "task.hiden=3",
        cwd=REPO,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu-console: --set: task.hiden: unknown key; did you mean 'hidden'? (got 3)"
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


# Its data sets take long to build outside a rank (what the launch's own check runs).
SLOW_DATA = """
import os
import subprocess
import time
from gpu_console.tasks.mlp import MLPTask


class SlowData(MLPTask):
    def build_datasets(self):
        if "LOCAL_RANK" not in os.environ:
            # A loading helper of the task's own, in the launch's check (as a pool would be).
            helper = subprocess.Popen(["sleep", "600"])
            with open(os.environ["HELPER_PID_FILE"], "a") as f:
                f.write(f"{helper.pid}\\n")
            time.sleep(120)
        return super().build_datasets()
"""


def helper_pids(pids_file) -> list[int]:
    """The pids a test task wrote, one a line (none yet: an empty list)."""
    return [int(x) for x in pids_file.read_text().split()] if pids_file.exists() else []


@contextlib.contextmanager
def helpers_ended(pids_file):
    """Whatever happens inside, the helpers a test task started are ended, by their pids."""
    from conftest import pid_alive

    try:
        yield
    finally:
        for pid in helper_pids(pids_file):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def launch(procs, profile, runs_dir, tmp_path, env, timeout: float) -> str:
    """``run PROFILE --headless`` on one CPU rank (what is checked is the launch's and each
    rank's own), which must succeed: its output."""
    result = procs.cli(
        "run", str(profile), "--headless", "--devices", "cpu:1", "--runs-dir", str(runs_dir),
        cwd=tmp_path, env=env, timeout=timeout,
    )  # fmt: skip
    both = result.stdout + result.stderr
    assert result.returncode == 0, both
    return both


def test_a_slow_data_set_does_not_hold_the_launch(procs, runs_dir, tmp_path):
    # The launch checks a user task's data set size within a time limit; past it the launch
    # goes on, says so, and the ranks apply the same rule (launch.check_data). The check's
    # process is killed there, so its exit handlers never run: the console removes its
    # temporary run directory and ends what the task started.
    from conftest import pid_alive, task_profile, test_env, wait_for

    profile = task_profile(tmp_path, "slowdata", SLOW_DATA, "SlowData", max_steps=5)
    scratch, pids_file = tmp_path / "tmp", tmp_path / "helpers.txt"
    scratch.mkdir()
    env = test_env(
        GPU_CONSOLE_DATA_CHECK_S="2", TMPDIR=str(scratch), HELPER_PID_FILE=str(pids_file)
    )
    with helpers_ended(pids_file):
        both = launch(procs, profile, runs_dir, tmp_path, env, timeout=100)
        assert "data.batch_size: not checked before launch" in both, both
        assert "took over 2 s to build" in both, both
        assert events_of(only_run(runs_dir), "step")[-1]["step"] == 5
        assert list(scratch.glob("gpu-console-plan-*")) == []
        pids = helper_pids(pids_file)  # none if the check was stopped before it started one
        wait_for(lambda: not any(map(pid_alive, pids)), what="the task's helper to be ended")


# Says, in a file, each process that imports it and each that builds its data sets; its
# config has an optional key, left at None.
COUNTED = """
import os
from dataclasses import dataclass
from gpu_console.tasks.configs import MLPConfig
from gpu_console.tasks.mlp import MLPTask

def _say(what):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(f"{what} {os.getpid()} {os.environ.get('LOCAL_RANK', '-')}\\n")

_say("import")


@dataclass
class Config(MLPConfig):
    limit: int | None = None  # an optional key, left at None


class Counted(MLPTask):
    Config = Config

    def build_datasets(self):
        _say("data")
        return super().build_datasets()
"""


def seen(path) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in path.read_text().splitlines()]


class CountedRun:
    """A finished launch of the counted task: where it was launched from, its profile, its
    run, and what its processes said (``seen``), read when it ended."""

    def __init__(self, where: Path, profile: Path, run: Path, said: list[tuple[str, str, str]]):
        self.where, self.profile, self.run, self.said = where, profile, run, said

    def refused(self, procs, tmp_path: Path, *more: str):
        """A launch of the same profile with ``more`` arguments, in ``tmp_path``'s runs
        directory (a refused one writes none there); the result and what was said."""
        from conftest import test_env

        said = tmp_path / "seen.txt"
        said.unlink(missing_ok=True)  # what an earlier launch of the test said
        result = procs.cli(
            "run", str(self.profile), "--headless", "--runs-dir", str(tmp_path / "runs"),
            *more, cwd=self.where, env=test_env(SEEN_FILE=str(said)),
        )  # fmt: skip
        return result, seen(said)


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> CountedRun:
    """One launch of the counted task: 2 steps on the profile's one CPU rank."""
    where = tmp_path_factory.mktemp("counted")
    profile = task_profile(where, "counted", COUNTED, "Counted", max_steps=2)
    said = where / "seen.txt"
    procs = Procs(where / "runs")
    try:
        result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(where / "runs"),
                           cwd=where, env=pinned_env(SEEN_FILE=str(said)))  # fmt: skip
    finally:
        procs.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    return CountedRun(where, profile, only_run(where / "runs"), seen(said))


def test_a_launch_checks_a_user_task_and_counts_its_data_in_one_process(
    procs, counted, tmp_path, runs_dir
):
    # Each torch start-up before the run is seconds: the key check and the data count share one.
    before = [s for s in counted.said if s[2] == "-"]  # not a rank
    assert [what for what, _, _ in before] == ["import", "data"]
    assert before[0][1] == before[1][1]  # the same process
    assert ("data", "0") in {(what, rank) for what, _, rank in counted.said}  # the rank's own

    result, said = counted.refused(procs, tmp_path, "--set", "task.hiden=3")
    assert result.returncode == 2
    assert "task.hiden: unknown key" in result.stderr
    assert [what for what, _, _ in said] == ["import"]  # keys wrong: no data built

    # The keys hold, a later check refuses: the data sets are not built either.
    result, said = counted.refused(procs, tmp_path, "--precision", "fp16")
    assert result.returncode == 2
    assert result.stderr.startswith("gpu-console: --precision: train.precision: ")
    assert [what for what, _, _ in said] == ["import"]
    assert run_dirs(runs_dir) == []  # neither refusal made a run
    assert run_dirs(counted.run.parent) == [counted.run]  # the first launch's run alone


NO_DATA = """
from gpu_console.tasks.mlp import MLPTask

print("a line of the user's own, on import")


class NoData(MLPTask):
    def build_datasets(self):
        raise FileNotFoundError("/data/train.bin")
"""


def test_a_user_task_whose_data_cannot_be_built_is_refused_in_one_line(procs, runs_dir, tmp_path):
    from conftest import task_profile

    profile = task_profile(tmp_path, "nodata", NO_DATA, "NoData", max_steps=2)
    result = procs.cli(
        "run", str(profile), "--headless", "--devices", "cpu:1", "--runs-dir", str(runs_dir),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "gpu-console: task nodata:NoData: build_datasets() failed: "
        "FileNotFoundError: /data/train.bin"
    ]
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


# Its data sets start a helper that would outlive the process (a server, a persistent pool)
# and a thread that would hold its exit; it prints JSON lines of its own, shaped like the
# check's and the plan's answers.
LINGERING = """
import os
import subprocess
import threading
import time
from gpu_console.tasks.mlp import MLPTask

print('{"check": {"errors": ["a line of the task\\'s own"], "task": {}}}', flush=True)


class Lingering(MLPTask):
    def build_datasets(self):
        if "LOCAL_RANK" in os.environ:  # the ranks: the launch's and the plan's check only
            return super().build_datasets()
        print('{"data": {"path": "data/"}}', flush=True)
        print('{"error": "a line of the task\\'s own"}', flush=True)
        threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon
        helper = subprocess.Popen(["sleep", "600"])
        with open(os.environ["HELPER_PID_FILE"], "a") as f:
            f.write(f"{helper.pid}\\n")
        return super().build_datasets()
"""


def test_a_dry_run_answers_and_ends_what_the_task_left_running(procs, runs_dir, tmp_path):
    # The helper holds the plan's output open: a dry run that read to the end of its output
    # waited out its 300 s limit and failed. It is answered when the plan ends, and the
    # plan's process group (the helper with it) is ended. The task's own JSON lines are not
    # taken for the plan's.
    from conftest import pid_alive, task_profile, test_env, wait_for

    profile = task_profile(tmp_path, "lingering", LINGERING, "Lingering", max_steps=5)
    pids_file = tmp_path / "helpers.txt"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = test_env(HELPER_PID_FILE=str(pids_file), TMPDIR=str(scratch))
    with helpers_ended(pids_file):
        result = procs.cli(
            "run", str(profile), "--dry-run", "--no-step", "--devices", "cpu:2",
            "--runs-dir", str(runs_dir), cwd=tmp_path, env=env, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "lingering:Lingering" in result.stdout
        pids = helper_pids(pids_file)
        assert pids  # the plan built the data sets
        wait_for(lambda: not any(map(pid_alive, pids)), what="the task's helpers to be ended")
        assert list(scratch.glob("gpu-console-plan-*")) == []
        assert not runs_dir.exists()


def test_a_launch_counts_the_data_of_a_task_that_left_a_helper_running(procs, runs_dir, tmp_path):
    # The launch's check reads the count when it is printed, not at the end of an output the
    # helper holds open (that waited out the data limit and launched unchecked); the task's
    # own JSON lines, shaped like the check's and the count's, are not taken for them.
    from conftest import pid_alive, task_profile, test_env, wait_for

    profile = task_profile(tmp_path, "lingering", LINGERING, "Lingering", max_steps=3)
    pids_file = tmp_path / "helpers.txt"
    env = test_env(HELPER_PID_FILE=str(pids_file), GPU_CONSOLE_DATA_CHECK_S="120")
    with helpers_ended(pids_file):
        both = launch(procs, profile, runs_dir, tmp_path, env, timeout=110)
        assert "not checked before launch" not in both, both
        assert events_of(only_run(runs_dir), "step")[-1]["step"] == 3
        pids = helper_pids(pids_file)
        assert len(pids) == 1  # the launch's check: one process, before the ranks
        wait_for(lambda: not pid_alive(pids[0]), what="the task's helper to be ended")


def test_an_optional_key_left_at_none_launches_and_is_still_checked(procs, counted, tmp_path):
    # Every launch of such a task failed: "task.limit: expected an integer (got None)".
    # The counted task's config has one (``limit``): its launch went through.
    assert events_of(counted.run, "status")[-1]["state"] == "finished"
    assert "\nlimit =" not in (counted.run / "run.toml").read_text()  # TOML has no null
    bad, said = counted.refused(procs, tmp_path, "--set", 'task.limit="many"')
    assert bad.returncode == 2
    assert bad.stderr.strip() == "gpu-console: --set: task.limit: expected an integer (got 'many')"
    assert [what for what, _, _ in said] == ["import"]  # keys wrong: no data built
