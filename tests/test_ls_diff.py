"""Finding and comparing runs: ``ls --state/--since/--profile/--sort`` and ``diff RUN1 RUN2``.

Three real runs through torchrun, one CPU rank each (two that finish with different learning
rates, one that fails on a NaN loss), then the commands as a user types them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import POISONED_TASK, Procs, fast_profile, read_status, task_profile

from gpu_console.runs import EXIT_BAD_INPUT

# Rank 0's loss is NaN on its 5th and 6th batches: a failed run on one rank (nothing this
# module reads crosses ranks).
POISONED_ONE_RANK = POISONED_TASK.replace('os.environ["RANK"] == "1"', 'os.environ["RANK"] == "0"')
assert POISONED_ONE_RANK != POISONED_TASK


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ls-diff")
    runs = tmp / "runs"
    procs = Procs(runs)
    try:
        made = {}
        for name, sets in (("alpha", []), ("beta", ["--set", "train.lr=0.05"])):
            profile = fast_profile(tmp, name=name, max_steps=10)
            done = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs),
                             *sets, cwd=tmp)  # fmt: skip
            assert done.returncode == 0, done.stderr
        poisoned = task_profile(tmp, "poisoned", POISONED_ONE_RANK, "Poisoned", max_steps=12)
        poisoned.write_text(poisoned.read_text().replace('name = "fast"', 'name = "gamma"'))
        done = procs.cli("run", str(poisoned), "--headless", "--runs-dir", str(runs), cwd=tmp)
        assert done.returncode == 1, done.stderr
        for run in runs.iterdir():
            made[run.name.split("-")[0]] = run
        assert sorted(made) == ["alpha", "beta", "gamma"]
        assert read_status(made["gamma"])["state"] == "failed"
        yield procs, runs, made
    finally:
        procs.cleanup()


def _ls(procs: Procs, runs: Path, *args: str) -> list[dict]:
    done = procs.cli("ls", "--json", "--runs-dir", str(runs), *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _names(rows: list[dict]) -> list[str]:
    return [r["name"].split("-")[0] for r in rows]


def test_ls_filters_by_state_profile_and_time(three_runs):
    procs, runs, made = three_runs
    failed = _ls(procs, runs, "--state", "failed")
    assert _names(failed) == ["gamma"] and failed[0]["exit_code"] == 1
    assert sorted(_names(_ls(procs, runs, "--state", "finished,failed"))) == [
        "alpha",
        "beta",
        "gamma",
    ]
    assert sorted(_names(_ls(procs, runs, "--state", "ended"))) == ["alpha", "beta", "gamma"]
    assert _ls(procs, runs, "--state", "live") == []
    alpha = _ls(procs, runs, "--profile", "al*")
    assert _names(alpha) == ["alpha"] and alpha[0]["profile"] == "alpha"
    assert _names(_ls(procs, runs, "--profile", made["beta"].name)) == ["beta"]  # a run's name
    assert len(_ls(procs, runs, "--since", "1h")) == 3
    assert _ls(procs, runs, "--since", "2999-01-01") == []
    done = procs.cli("ls", "--runs-dir", str(runs), "--state", "running")
    assert done.returncode == 0 and done.stdout.strip() == f"no run under {runs} matches"


def test_ls_sorts_by_name_loss_and_start(three_runs):
    procs, runs, _ = three_runs
    assert _names(_ls(procs, runs, "--sort", "name")) == ["alpha", "beta", "gamma"]
    rows = _ls(procs, runs, "--sort", "loss")
    finite = [r["loss"] for r in rows if isinstance(r["loss"], float) and math.isfinite(r["loss"])]
    assert [r["loss"] for r in rows[: len(finite)]] == sorted(finite)  # lowest first, NaN last
    started = [r["started"] for r in _ls(procs, runs, "--sort", "started")]
    assert started == sorted(started, reverse=True)
    default = _names(_ls(procs, runs))  # the newest session first, as before
    assert default == _names(_ls(procs, runs, "--sort", "started"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--state", "bogus"), "--state: one of starting, "),
        (("--since", "yesterday"), "--since: a time ago like 90m"),
        (("--sort", "colour"), "--sort: one of started, updated, name"),
    ],
)
def test_a_bad_ls_option_is_one_line_exit_2(three_runs, args, says):
    procs, runs, _ = three_runs
    done = procs.cli("ls", "--runs-dir", str(runs), *args)
    assert done.returncode == EXIT_BAD_INPUT and done.stdout == ""
    assert done.stderr.startswith(f"gpu-console: {says}") and done.stderr.count("\n") == 1


def test_diff_shows_the_keys_that_differ_and_the_figures_side_by_side(three_runs):
    procs, runs, made = three_runs
    done = procs.cli(
        "diff", made["alpha"].name, made["beta"].name, "--json", "--runs-dir", str(runs)
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    changes = {c["key"]: (c["a"], c["b"]) for c in out["profile"]}
    assert changes["train.lr"] == (0.003, 0.05)
    assert changes["profile.name"] == ("alpha", "beta")
    assert set(changes) == {"train.lr", "profile.name"}  # nothing else differs
    rows = {r["what"]: (r["a"], r["b"]) for r in out["figures"]}
    assert rows["state"] == ("finished (max_steps reached)",) * 2
    assert rows["steps"] == ("10/10",) * 2
    ls = {r["name"]: r for r in _ls(procs, runs)}
    for side, run in (("a", made["alpha"]), ("b", made["beta"])):
        assert out["summary"][side]["loss"] == ls[run.name]["loss"]  # the same figures as ls
    assert [r["name"] for r in out["runs"]] == [made["alpha"].name, made["beta"].name]

    text = procs.cli("diff", made["alpha"].name, made["gamma"].name, "--runs-dir", str(runs))
    assert text.returncode == 0, text.stderr
    assert "train.lr" not in text.stdout and "task.kind" in text.stdout  # a user task
    assert "failed" in text.stdout and "finished" in text.stdout


def test_diff_of_a_run_with_itself_and_of_a_missing_run(three_runs):
    procs, runs, made = three_runs
    same = procs.cli("diff", made["alpha"].name, made["alpha"].name, "--runs-dir", str(runs))
    assert same.returncode == 0 and same.stdout.startswith("profile: the same")
    missing = procs.cli("diff", made["alpha"].name, "nope", "--runs-dir", str(runs))
    assert missing.returncode == EXIT_BAD_INPUT and missing.stdout == ""
    assert missing.stderr.startswith("gpu-console: ") and missing.stderr.count("\n") == 1


def test_diff_of_a_run_whose_run_toml_is_damaged_is_one_line(three_runs, tmp_path):
    # Not every key "(missing)" and exit 0: the damaged file, named, and nothing on stdout.
    procs, runs, made = three_runs
    damaged = tmp_path / "runs" / made["beta"].name
    shutil.copytree(made["beta"], damaged)
    (damaged / "run.toml").write_text("[train\nlr = ")
    for args in ([made["alpha"].name, str(damaged)], [str(damaged), made["alpha"].name, "--json"]):
        done = procs.cli("diff", *args, "--runs-dir", str(runs))
        assert done.returncode == EXIT_BAD_INPUT and done.stdout == "", done.stdout
        assert done.stderr.startswith(f"gpu-console: {damaged / 'run.toml'}: not valid TOML")
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
