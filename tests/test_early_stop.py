"""Early stopping (``train.early_stop_*``, engine/early_stop.py) on the engine harness: a run
whose eval metric stops improving ends ``finished`` with the reason at the expected step,
``min_delta`` is respected, a run stopped mid-patience and resumed stops at the step an
uninterrupted run stops at, a resume of a run that stopped early is refused unless it can
train on, and a run without the keys trains as before. Bad keys through the real CLI are in
test_bad_input.py (``FILE_CASES``)."""

from __future__ import annotations

import json

import pytest
from conftest import events_of, task_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console.launch import LaunchError
from gpu_console.profile import ProfileError, load_profile
from gpu_console.tui.feed import RunFeed

pytestmark = pytest.mark.quick

# The eval metric "score" is the task's own figure (on_eval_end), a fixed value per step:
# deterministic, and the same after a resume (ctx.step is restored with the checkpoint).
# SCORES is a dict literal per test, put in by the profile's module.
TASK = """
import os
import time
from gpu_console.tasks.mlp import MLPTask

SCORES = {scores}


class Scored(MLPTask):
    def compute(self, model, batch):
        if model.training:
            time.sleep(float(os.environ.get("PACE_S", "0")))
        return super().compute(model, batch)

    def on_eval_end(self, model, metrics, ctx):
        return {{"score": SCORES.get(ctx.step, SCORES["rest"])}}
"""

EARLY = """
[checkpoint]
keep_last = 0
"""


def _profile(tmp_path, scores, max_steps, name="scored"):
    source = TASK.format(scores=scores)
    return task_profile(tmp_path, name, source, "Scored", max_steps=max_steps, extra=EARLY)


def _ending(run):
    (status,) = [e for e in events_of(run, "status") if e["state"] in ("finished", "stopped")][-1:]
    return status["state"], status["step"], status["reason"]


def _counts(run):
    return [(e["step"], e["evals_since_best"], e["stop"]) for e in events_of(run, "early_stop")]


def _meta(run, step):
    return json.loads((run / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())


# Every 5 steps: 10, 8, then gains of 0.03 (together still below a min_delta of 0.1, each
# above 0), none at 30, one of 0.91 at step 35, then none.
DELTAS = '{5: 10.0, 10: 8.0, 15: 7.97, 20: 7.94, 25: 7.91, 30: 7.91, 35: 7.0, "rest": 7.0}'


def test_min_delta_decides_what_counts_as_an_improvement(tmp_path, runs_dir):
    profile = _profile(tmp_path, DELTAS, max_steps=80)
    sets = ("train.eval_every=5", "train.early_stop_metric=eval.score",
            "train.early_stop_mode=min", "train.early_stop_patience=3")  # fmt: skip

    # min_delta 0.1: the gains of 0.04 are not improvements; 3 evals after step 10 it stops.
    run = run_engine(tmp_path, profile, *sets, "train.early_stop_min_delta=0.1",
                     runs_dir=runs_dir, name="delta")  # fmt: skip
    reason = ("early stopping: eval.score did not improve by more than 0.1 for 3 evals "
              "(best 8 at step 10)")  # fmt: skip
    assert _ending(run) == ("finished", 25, reason)
    assert _counts(run) == [(5, 0, False), (10, 0, False), (15, 1, False), (20, 2, False),
                            (25, 3, True)]  # fmt: skip
    assert max(e["step"] for e in events_of(run, "step")) == 25  # no step after the stop
    assert [e["step"] for e in events_of(run, "eval")] == [5, 10, 15, 20, 25]
    # The end checkpoint, as at max_steps; it holds the count (and meta.json says it).
    saved = [(e["step"], e["reason"]) for e in events_of(run, "checkpoint")]
    assert saved == [(25, "end")]
    rec = _meta(run, 25)["early_stop"]
    assert (rec["best"], rec["best_step"], rec["stale"], rec["stopped"]) == (8.0, 10, 3, True)
    printed = headless_text(run)
    assert f"state: finished ({reason})" in printed, printed
    assert "early stopping: 2/3 evals without improvement (best 8.0000 at step 10)" in printed
    assert "early stopping @ step 25: 3 evals without improvement" in printed, printed
    feed = RunFeed(run, telemetry=False)  # the run screen's log pane
    feed.load()
    logs = [(ln.level, ln.text) for ln in feed.model.logs if ln.text.startswith("early ")]
    assert logs[-2:] == [
        ("info", "early stopping: 2/3 evals without improvement (best 8.0000 at step 10)"),
        ("warning", "early stopping @ step 25: 3 evals without improvement (best 8.0000 at "
                    "step 10)"),
    ]  # fmt: skip

    # min_delta 0 (the default): every gain counts; the run stops 3 evals after step 35.
    run = run_engine(tmp_path, profile, *sets, runs_dir=runs_dir, name="any")
    assert _ending(run) == (
        "finished",
        50,
        "early stopping: eval.score did not improve for 3 evals (best 7 at step 35)",
    )
    assert [c[1] for c in _counts(run)] == [0, 0, 0, 0, 0, 1, 0, 1, 2, 3]


# Best at step 10, then worse for ever: with a patience of 4 the run stops at step 30.
PLATEAU = '{5: 10.0, 10: 8.0, "rest": 9.0}'
PLATEAU_SETS = ("train.eval_every=5", "train.early_stop_metric=eval.score",
                "train.early_stop_mode=min", "train.early_stop_patience=4")  # fmt: skip


def test_a_resume_mid_patience_stops_where_an_uninterrupted_run_does(tmp_path, runs_dir):
    profile = _profile(tmp_path, PLATEAU, max_steps=60)
    whole = run_engine(tmp_path, profile, *PLATEAU_SETS, runs_dir=runs_dir, name="whole")
    reason = "early stopping: eval.score did not improve for 4 evals (best 8 at step 10)"
    assert _ending(whole) == ("finished", 30, reason)

    # Stopped (the console's stop command) after step 12: a checkpoint mid-patience.
    cut = run_engine(tmp_path, profile, *PLATEAU_SETS, runs_dir=runs_dir, name="cut",
                     env={"PACE_S": "0.1"}, stop_after=12)  # fmt: skip
    state, stopped_at, _ = _ending(cut)
    assert state == "stopped" and 12 <= stopped_at < 30, (state, stopped_at)
    rec = _meta(cut, stopped_at)["early_stop"]
    assert (rec["best"], rec["best_step"], rec["stopped"]) == (8.0, 10, False)
    assert rec["stale"] == (stopped_at // 5) - 2  # evals since step 10's

    # Resumed: the count goes on from the checkpoint's (a new count would stop at 35).
    run_engine(tmp_path, None, resume=cut, runs_dir=runs_dir)
    assert _ending(cut) == ("finished", 30, reason)
    after = [c for c in _counts(cut) if c[0] > stopped_at]
    assert after == [c for c in _counts(whole) if c[0] > stopped_at]
    assert max(e["step"] for e in events_of(cut, "step")) == 30

    # Resuming a run that stopped early: refused with the same settings (it would stop at
    # its next eval), nothing run; a larger patience trains on from the count it had.
    with pytest.raises(LaunchError, match=r"stopped early at step 30 .*early_stop_patience"):
        run_engine(tmp_path, None, resume=whole, runs_dir=runs_dir)
    assert _ending(whole) == ("finished", 30, reason)
    run_engine(tmp_path, None, "train.early_stop_patience=6", resume=whole, runs_dir=runs_dir)
    six = reason.replace("for 4 evals", "for 6 evals")
    assert _ending(whole) == ("finished", 40, six)
    # Turned off: the run trains to max_steps.
    run_engine(tmp_path, None, "train.early_stop_metric=''", resume=whole, runs_dir=runs_dir)
    assert _ending(whole) == ("finished", 60, "max_steps reached")
    assert max(c[0] for c in _counts(whole)) == 40  # no early_stop event once off


def test_two_ranks_stop_at_the_same_step(tmp_path, runs_dir):
    # Rank 0's verdict is broadcast at each eval: both ranks end at step 30, none hangs.
    profile = _profile(tmp_path, PLATEAU, max_steps=60)
    run = run_engine(tmp_path, profile, *PLATEAU_SETS, ranks=2, runs_dir=runs_dir)
    reason = "early stopping: eval.score did not improve for 4 evals (best 8 at step 10)"
    assert _ending(run) == ("finished", 30, reason)
    assert [c[1] for c in _counts(run)] == [0, 0, 1, 2, 3, 4]
    assert [(e["step"], e["reason"]) for e in events_of(run, "checkpoint")] == [(30, "end")]


def test_off_by_default_the_run_trains_to_max_steps(tmp_path, runs_dir):
    profile = _profile(tmp_path, PLATEAU, max_steps=30)
    run = run_engine(tmp_path, profile, "train.eval_every=5", runs_dir=runs_dir)
    assert _ending(run) == ("finished", 30, "max_steps reached")
    assert events_of(run, "early_stop") == []
    assert [e["step"] for e in events_of(run, "eval")] == [5, 10, 15, 20, 25, 30]
    assert "early_stop" not in _meta(run, 30)
    train = load_profile(str(run / "run.toml")).train
    assert (train.early_stop_metric, train.early_stop_patience) == ("", 3)


def test_an_unreported_metric_and_a_task_without_evals_are_refused(tmp_path, runs_dir):
    # Judged by the ranks (the metric names are the eval's): state refused, one line.
    profile = _profile(tmp_path, PLATEAU, max_steps=30)
    run = run_engine(tmp_path, profile, *PLATEAU_SETS, "train.early_stop_metric=eval.scor",
                     runs_dir=runs_dir, name="typo")  # fmt: skip
    (refused,) = [e for e in events_of(run, "status") if e["state"] == "refused"]
    assert refused["key"] == "train.early_stop_metric" and refused["step"] == 5
    assert refused["reason"] == (
        "train.early_stop_metric: the eval at step 5 has no such metric (it reported "
        "eval.accuracy, eval.loss, eval.score) (got 'eval.scor')"
    )
    assert not events_of(run, "early_stop")

    run = run_engine(tmp_path, profile, *PLATEAU_SETS, "task.eval_samples=0",
                     runs_dir=runs_dir, name="no-eval")  # fmt: skip
    (refused,) = [e for e in events_of(run, "status") if e["state"] == "refused"]
    assert refused["reason"] == (
        "train.early_stop_metric: the task has no eval set (got 'eval.score')"
    )
    assert not events_of(run, "step")


@pytest.mark.parametrize(
    "lines, says",
    [
        ('early_stop_metric = "loss"', "train.early_stop_metric: expected eval.<metric>"),
        ('early_stop_metric = "eval.loss"\neval_every = 0',
         "train.early_stop_metric: needs evals during the run"),
        ('early_stop_metric = "eval.accuracy"\neval_every = 5',
         "train.early_stop_mode: say min or max for eval.accuracy"),
        ('early_stop_metric = "eval.loss"\nmax_steps = 100\neval_every = 100\neval_at = [200]',
         "train.early_stop_metric: needs evals during the run"),
        ("early_stop_patience = 0", "train.early_stop_patience: must be at least 1 (got 0)"),
        ("early_stop_min_delta = -0.1",
         "train.early_stop_min_delta: must be at least 0.0 (got -0.1)"),
    ],
)  # fmt: skip
def test_bad_early_stop_keys_are_one_line_each(tmp_path, lines, says):
    path = tmp_path / "p.toml"
    path.write_text(f"[train]\n{lines}\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    (problem,) = e.value.problems
    assert problem.startswith(f"{path}: ") and says in problem, problem


def test_a_loss_needs_no_mode_and_evals_every_epoch_count(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[train]\nearly_stop_metric = "eval.val/loss"\neval_every_epochs = 1\n')
    train = load_profile(str(path)).train
    assert train.early_stop_direction() == "min"
    path.write_text('[train]\nearly_stop_metric = "eval.accuracy"\neval_at = [10, 20]\n'
                    'early_stop_mode = "max"\n')  # fmt: skip
    assert load_profile(str(path)).train.early_stop_direction() == "max"
