"""A task of the user's own, by import path, through the real CLI from the repo root."""

from __future__ import annotations

from conftest import REPO, events_of, only_run


def test_example_user_task_trains_from_its_import_path(procs, runs_dir):
    result = procs.cli(
        "run",
        "sine",
        "--headless",
        "--runs-dir",
        str(runs_dir),
        "--devices",
        "cpu:2",  # the profile says "auto": a GPU wherever NVML sees one
        "--set",
        "train.max_steps=120",
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    assert events_of(run, "start")[0]["task"] == "examples.sine_task:SineTask"
    steps = events_of(run, "step")
    assert steps[-1]["loss_avg"] < 0.5 * steps[0]["loss"]
    assert "hidden = 64" in (run / "run.toml").read_text()  # the user's keys are resolved too


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
