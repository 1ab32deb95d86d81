"""``gpu-console status RUN [--json]``: one run's summary, on a finished, a running and a
missing run, through the real CLI."""

from __future__ import annotations

import json

from conftest import (
    deadline,
    events_of,
    only_run,
    paced_profile,
    read_status,
    task_profile,
    the_run,
    wait_for,
)
from conftest import test_env as cli_env

from gpu_console.events import append_control

# Broken on the ranks only: the launch's own check builds the model too (and would refuse a
# build_model that always raises, exit 2), so this run fails where a launch cannot see it.
BROKEN_TASK = """
import os
from gpu_console.tasks.mlp import MLPTask


class Broken(MLPTask):
    def build_model(self):
        if "LOCAL_RANK" in os.environ:
            raise ValueError("no model today")
        return super().build_model()
"""


def _summary(stdout: str, run) -> list[str]:
    """The headless end summary: from its title line to the end."""
    lines = stdout.splitlines()
    return lines[lines.index(f"{run.name}: {read_status(run)['state']}") :]


def _ls_entry(procs, runs_dir) -> dict:
    (entry,) = json.loads(procs.cli("ls", "--json", "--runs-dir", str(runs_dir)).stdout)
    return entry


def test_status_of_a_finished_run_is_its_headless_summary(quickstart_run, procs):
    # The session's quickstart run (conftest): 300 steps on 2 CPU ranks, read, never changed.
    done, runs_dir = quickstart_run.result, quickstart_run.runs_dir
    rd = ["--runs-dir", str(runs_dir)]
    assert done.returncode == 0, done.stdout + done.stderr
    run = only_run(runs_dir)

    shown = procs.cli("status", run.name, *rd)  # by name; off a terminal: key: value lines
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == _summary(done.stdout, run)
    assert procs.cli("status", str(run)).stdout == shown.stdout  # by path, any runs dir

    as_json = procs.cli("status", run.name, "--json", *rd)
    assert as_json.returncode == 0, as_json.stderr
    got = json.loads(as_json.stdout)
    entry = _ls_entry(procs, runs_dir)
    # Every field of the run's `ls --json` entry, with its value (age_s is read at a time).
    assert set(entry) <= set(got)
    assert {k: v for k, v in got.items() if k in entry and k != "age_s"} == {
        k: v for k, v in entry.items() if k != "age_s"
    }
    # And the summary's own fields.
    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    assert got["checkpoint"]["path"] == str(run / "checkpoints" / latest)
    assert got["checkpoint"]["step"] == 300
    assert (got["state"], got["step"], got["max_steps"]) == ("finished", 300, 300)
    assert (got["world_size"], got["device_type"], got["precision"]) == (2, "cpu", "fp32")
    assert got["task"] == "mlp" and got["params"] > 0
    assert set(got["eval"]) == {"accuracy", "loss"}
    assert [m["rank"] for m in got["peak_memory"]] == [0, 1]
    assert got["samples_per_s"] > 0 and got["wall_s"] > 0 and got["failure"] is None


def test_status_of_a_running_run(procs, runs_dir, tmp_path):
    rd = ["--runs-dir", str(runs_dir)]
    profile = paced_profile(tmp_path, max_steps=100_000)
    console = procs.start("run", str(profile), "--headless", *rd, cwd=tmp_path,
                          env=cli_env(PACE_S="0.02"))  # fmt: skip
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(lambda: len(events_of(run, "step")) >= 3, what="three steps")
    wait_for(lambda: read_status(run).get("state") == "running", what="status.json running")

    shown = procs.cli("status", run.name, *rd)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"{run.name}: running"
    assert "state: running" in lines and "devices: 1 × cpu, fp32" in lines
    assert f"run dir: {run}" in lines
    steps = next(ln for ln in lines if ln.startswith("steps: "))
    assert steps.endswith("/100000") and int(steps.split()[1].split("/")[0]) >= 3

    got = json.loads(procs.cli("status", run.name, "--json", *rd).stdout)
    assert got["state"] == "running" and got["step"] >= 3 and got["max_steps"] == 100_000
    assert got["name"] == run.name and got["failure"] is None

    append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    assert json.loads(procs.cli("status", run.name, "--json", *rd).stdout)["state"] == "stopped"


def test_a_run_that_failed_before_its_first_step_is_summarised_with_what_was_known(
    procs, runs_dir, tmp_path
):
    """No start event came: steps, devices, task and precision are the launch's (run.toml,
    meta.json), in the headless summary and in `status`, never dashes."""
    profile = task_profile(tmp_path, "broken", BROKEN_TASK, "Broken", max_steps=20)
    rd = ["--runs-dir", str(runs_dir)]
    done = procs.cli("run", str(profile), "--headless", *rd, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    run = only_run(runs_dir)
    assert not events_of(run, "start")
    known = {"steps: 0/20", "devices: 1 × cpu, fp32", "task: broken:Broken"}
    assert known <= set(done.stdout.splitlines()), done.stdout
    lines = procs.cli("status", run.name, *rd).stdout.splitlines()
    assert lines == _summary(done.stdout, run)
    got = json.loads(procs.cli("status", run.name, "--json", *rd).stdout)
    assert (got["state"], got["max_steps"], got["task"]) == ("failed", 20, "broken:Broken")
    assert "no model today" in got["failure"]["summary"]


def test_status_of_a_missing_run_is_one_line_and_exit_2(procs, runs_dir, tmp_path):
    for args in (["ghost"], ["ghost", "--json"], [str(tmp_path / "nowhere")]):
        result = procs.cli("status", *args, "--runs-dir", str(runs_dir))
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"gpu-console: {args[0]}: no such run")
    assert not runs_dir.exists()  # nothing written
