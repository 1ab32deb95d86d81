"""``nan_policy = "skip"`` says what it skipped, fails a run that learns nothing, and every
JSON the project writes after a NaN stays strict JSON (no bare ``NaN``/``Infinity``).

The last rank's loss is NaN from step 5 on, so every update from step 5 is skipped on every
rank (the gradient norm is all-reduced): on 2 CPU ranks of the engine harness
(tests/harness.py), and through real torchrun where the console reads the run (status.json,
``ls``, ``status``, the headless summary): on one rank for the failed run's report, on 2 for
the finished run's files (each rank's heartbeat).
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import events_of, fast_profile, only_run, read_status, task_profile
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console import strict_json
from gpu_console.engine.nonfinite import ENV, SkipStreak
from gpu_console.fold import RunFold
from gpu_console.profile import ProfileError, load_profile
from gpu_console.summary import skipped_text

ALWAYS_NAN_TASK = """
import os
from gpu_console.tasks.mlp import MLPTask


class AlwaysNan(MLPTask):
    calls = 0

    def compute(self, model, batch):
        AlwaysNan.calls += 1
        out = super().compute(model, batch)
        last = str(int(os.environ["WORLD_SIZE"]) - 1)
        if os.environ["RANK"] == last and AlwaysNan.calls >= 5:
            out.loss = out.loss * float("nan")
        return out
"""


def _reject(token: str):
    raise AssertionError(f"not strict JSON: bare {token}")


def strict(text: str):
    """Parse as a strict reader does (JavaScript's JSON.parse refuses NaN and Infinity)."""
    return json.loads(text, parse_constant=_reject)


def _nan_profile(tmp_path, ranks: int = 2):
    return task_profile(tmp_path, "always_nan", ALWAYS_NAN_TASK, "AlwaysNan", max_steps=30,
                        ranks=ranks)  # fmt: skip


SKIP = ["train.nan_policy=skip", "train.log_every=3"]


def _nan_run(procs, tmp_path, check: str, *sets: str, ranks: int = 2):
    args = []
    for s in [*SKIP, *sets]:
        args += ["--set", s]
    runs = tmp_path / "runs"
    env = cli_env(**{ENV: check})
    result = procs.cli(
        "run", str(_nan_profile(tmp_path, ranks)), "--headless", "--runs-dir", str(runs), *args,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    return result, only_run(runs), env


@pytest.mark.parametrize("check", ["each-step", "deferred"])
def test_a_run_whose_updates_are_all_skipped_fails_and_says_how_many(tmp_path, check):
    # The engine on 2 ranks (the harness, tests/harness.py); the console's view of such a
    # run is the next test's.
    run = run_engine(tmp_path, _nan_profile(tmp_path), *SKIP, "train.nan_skip_limit=6",
                     ranks=2, env={ENV: check})  # fmt: skip
    # Steps 5.. are skipped; the streak is judged at log steps (3, 6, 9, 12): 8 ≥ 6 at 12.
    ended = events_of(run, "status")[-1]
    assert ended["state"] == "failed"
    assert "the last 8 updates (steps 5-12) were all skipped" in ended["reason"]
    assert [e["skipped"] for e in events_of(run, "step")] == [0, 2, 3, 3]

    # Every line of events.jsonl is strict JSON; the NaN loss is null plus its flag.
    raw = [strict(line) for line in (run / "events.jsonl").read_text().splitlines()]
    last = [e for e in raw if e["kind"] == "step"][-1]
    assert last["loss"] is None and last["loss_nonfinite"] == "nan"
    # ...and the project's own readers still see the NaN.
    assert math.isnan(events_of(run, "step")[-1]["loss"])
    strict((run / "meta.json").read_text())


def test_the_console_reports_a_run_whose_updates_are_all_skipped(procs, tmp_path):
    # The console's report: one rank (the engine's agreement over 2 is the test above's).
    result, run, env = _nan_run(procs, tmp_path, "each-step", "train.nan_skip_limit=6", ranks=1)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    status = read_status(run)
    assert status["state"] == "failed" and status["exit_code"] == 1
    # The rank exited 0 so that torchrun would not restart it: the engine failed the run,
    # and the run's exit code says failed (DESIGN.md: 1) whatever torchrun's own.
    assert status["torchrun_exit"] == 0 and status["failure"]["rank"] is None
    assert "the last 8 updates (steps 5-12) were all skipped" in status["reason"]
    assert status["skipped_updates"] == 8
    assert "skipped updates: 8 of 12" in out  # the headless end table
    strict((run / "status.json").read_text())
    strict((run / "meta.json").read_text())

    runs = ["--runs-dir", str(tmp_path / "runs")]
    ls = procs.cli("ls", "--json", *runs, cwd=tmp_path, env=env)
    (row,) = strict(ls.stdout)
    assert (row["state"], row["exit_code"], row["skipped_updates"]) == ("failed", 1, 8)
    assert row["loss"] is None and row["loss_nonfinite"] == "nan"
    shown = procs.cli("status", run.name, "--json", *runs, cwd=tmp_path, env=env)
    doc = strict(shown.stdout)
    assert (doc["state"], doc["skipped_updates"], doc["loss_nonfinite"]) == ("failed", 8, "nan")
    text = procs.cli("status", run.name, *runs, cwd=tmp_path, env=env).stdout
    assert "skipped updates: 8 of 12" in text and "final loss: nan" in text
    assert "failed" in text and "were all skipped" in text


def test_a_skip_run_under_the_limit_finishes_and_counts_its_skips(procs, tmp_path):
    result, run, _ = _nan_run(procs, tmp_path, "each-step", "train.nan_skip_limit=0")
    assert result.returncode == 0, result.stdout + result.stderr
    status = read_status(run)
    assert (status["state"], status["skipped_updates"]) == ("finished", 26)
    assert "skipped updates: 26 of 30" in result.stdout
    # Every file of the run the project wrote as JSON, line by line where it is JSONL.
    for name in ("events.jsonl", "telemetry.jsonl"):
        for line in (run / name).read_text().splitlines():
            strict(line)
    documents = [run / "status.json", run / "meta.json", *run.glob("checkpoints/*/meta.json")]
    documents += run.glob("heartbeats/*.json")
    assert len(documents) > 4
    for path in documents:
        strict(path.read_text())


def test_the_streak_counts_updates_skipped_in_a_row():
    streak = SkipStreak(3)
    for step, skipped in enumerate([True, True, False, True, True], start=1):
        streak.record(step, skipped)
    assert not streak.tripped and streak.count == 2
    streak.record(6, True)
    assert streak.tripped and "the last 3 updates (steps 4-6)" in streak.message(6)
    never = SkipStreak(0)
    for step in range(1, 1000):
        never.record(step, True)
    assert not never.tripped


def test_the_fold_sums_skipped_updates_over_sessions():
    fold = RunFold()
    assert fold.to_status().get("skipped_updates") is None  # another policy: no count
    fold.carry({"skipped_updates": 5})
    for step, skipped in ((3, 0), (6, 2)):
        fold.apply({"v": 1, "t": 1.0, "kind": "step", "step": step, "skipped": skipped})
    assert fold.to_status()["skipped_updates"] == 7
    assert skipped_text(7, 6) == "7 of 6 (non-finite gradient; nan_policy = skip)"


def test_strict_json_round_trips_non_finite_numbers():
    doc = {"loss": math.nan, "lrs": [math.inf, 1.0], "m": {"acc": -math.inf}, "ok": 1.5}
    text = strict_json.dumps(doc)
    assert strict(text) == {
        "loss": None,
        "loss_nonfinite": "nan",
        "lrs": [None, 1.0],
        "m": {"acc": None, "acc_nonfinite": "-inf"},
        "ok": 1.5,
    }
    back = strict_json.loads(text)
    assert math.isnan(back["loss"]) and "loss_nonfinite" not in back
    assert back["m"] == {"acc": -math.inf} and back["lrs"] == [None, 1.0]


def test_the_skip_limit_is_validated(tmp_path):
    path = str(fast_profile(tmp_path))
    assert load_profile(path).train.nan_skip_limit == 100
    assert load_profile(path, ["train.nan_skip_limit=0"]).train.nan_skip_limit == 0
    with pytest.raises(ProfileError) as info:
        load_profile(path, ["train.nan_skip_limit=-1"])
    assert "train.nan_skip_limit" in str(info.value.problems)
