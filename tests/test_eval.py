"""Eval as real scripts do it: its own batch size, an eval at step 0, metrics per sample,
progress while it runs, and a long eval never taken for a stall (2 CPU ranks: through real
torchrun where the console or the supervisor reads the run as it goes, else on the engine
harness, tests/harness.py).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from conftest import events_of, only_run, set_args, task_profile
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console.engine.evaluate import at_start
from gpu_console.engine.heartbeat import Heartbeat
from gpu_console.fold import RunFold, derived_state
from gpu_console.state import describe_stopped, read_heartbeats

# Eval samples are the numbers 0..9: an eval batch's loss is their mean, ``batch`` its size.
# Over 2 ranks in batches of 3, each rank's last batch is short (3 + 2 samples): the mean over
# samples is 4.5, a mean of the batches' means would be 5.0.
EVAL_TASK = """
import os
import time

import torch

from gpu_console.tasks.base import TaskOutput, TensorSet, perplexity
from gpu_console.tasks.mlp import MLPTask


class Numbers(MLPTask):
    derived_metrics = {"perplexity": perplexity}

    def build_datasets(self):
        train, _ = super().build_datasets()
        numbers = TensorSet(torch.arange(int(os.environ.get("EVAL_N", "10"))).float())
        if os.environ.get("SPLITS"):  # a second split: the numbers 10..19
            return train, {"val": numbers, "train_est": TensorSet(torch.arange(10, 20).float())}
        return train, numbers

    def compute(self, model, batch):
        if model.training:
            return super().compute(model, batch)
        time.sleep(float(os.environ.get("EVAL_PACE_S", "0")))
        (x,) = batch
        n = len(x)
        if os.environ.get("TOKENS"):  # sample i: i + 1 tokens, each of loss i
            loss = (x * (x + 1)).sum() / (x + 1).sum()
            return TaskOutput(loss=loss, samples=n, tokens=int((x + 1).sum()))
        return TaskOutput(loss=x.mean(), samples=n, metrics={"batch": torch.tensor(float(n))})
"""


def eval_profile(tmp_path: Path, max_steps: int, extra: str, ranks: int = 1) -> Path:
    profile = task_profile(
        tmp_path, "eval_numbers", EVAL_TASK, "Numbers", max_steps=max_steps, ranks=ranks
    )
    text = profile.read_text().replace("[data]\n", f"[data]\n{extra}\n", 1)
    profile.write_text(
        text.replace("log_every = 1", "log_every = 1\neval_every = 2\neval_at_start = true")
    )
    return profile


def test_eval_at_start_its_batch_size_and_a_mean_over_samples(tmp_path):
    profile = eval_profile(tmp_path, max_steps=4, extra="eval_batch_size = 3", ranks=2)
    evals = events_of(run_engine(tmp_path, profile, ranks=2), "eval")
    assert [e["step"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert e["loss"] == pytest.approx(4.5, abs=1e-9)  # 45 / 10 samples
        assert e["batch"] == pytest.approx((9 + 4) * 2 / 10)  # batches of 3 and 2 per rank
        assert e["perplexity"] == pytest.approx(math.exp(4.5))  # of the mean loss


def test_eval_at_adds_explicit_eval_points_step_1_included(procs, tmp_path):
    profile = eval_profile(tmp_path, max_steps=5, extra="")
    sets = ["train.eval_every=0", "train.eval_at=[3, 1, 99]"]
    plan = procs.cli("run", str(profile), "--dry-run", *set_args(*sets), cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "after steps 1, 3; at the end" in plan.stdout  # 99: past max_steps, never reached
    run = run_engine(tmp_path, profile, *sets)
    assert [e["step"] for e in events_of(run, "eval")] == [0, 1, 3, 5]
    bad = procs.cli("run", str(profile), "--dry-run", "--set", "train.eval_at=[0]", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "gpu-console: --set: train.eval_at: expected step numbers >= 1 (e.g. [1, 500]) (got [0])"
    ], bad.stderr


def test_a_resume_does_not_evaluate_again_at_its_start(tmp_path):
    profile = eval_profile(tmp_path, max_steps=3, extra="")
    run = run_engine(tmp_path, profile)
    assert [e["step"] for e in events_of(run, "eval")] == [0, 2, 3]  # 3: the end's
    run_engine(tmp_path, None, "train.max_steps=5", resume=run)
    assert [e["step"] for e in events_of(run, "eval")] == [0, 2, 3, 4, 5]  # no second at 3


# A task whose eval draws from its own generator, the one its training noise comes from, and
# which its state hooks checkpoint: one eval more or less changes every loss after it.
DRAWING_TASK = """
import os
import time

import torch

from gpu_console.tasks.base import TaskOutput
from gpu_console.tasks.mlp import MLPTask


class Drawing(MLPTask):
    def __init__(self, config):
        super().__init__(config)
        self.gen = torch.Generator().manual_seed(7)

    def compute(self, model, batch):
        out = super().compute(model, batch)
        draw = torch.rand((), generator=self.gen)
        if not model.training:
            return out
        time.sleep(float(os.environ.get("PACE_S", "0")))
        return TaskOutput(loss=out.loss * (1 + draw), samples=out.samples, metrics=out.metrics)

    def state_dict(self):
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])
"""


def test_a_stopped_run_resumed_with_eval_at_start_trains_as_an_uninterrupted_one(
    runs_dir, tmp_path
):
    # No eval_every: the run evaluates at step 0 and at its end only, so the stop's step is
    # one where the uninterrupted run did not evaluate.
    profile = task_profile(tmp_path, "drawing", DRAWING_TASK, "Drawing", max_steps=12)
    profile.write_text(
        profile.read_text().replace("log_every = 1", "log_every = 1\neval_at_start = true")
    )
    whole_run = run_engine(tmp_path, profile, runs_dir=tmp_path / "whole")

    # Stopped by the console's command once it made step 3 (paced, so it does not end first).
    run = run_engine(tmp_path, profile, runs_dir=runs_dir, env={"PACE_S": "0.1"}, stop_after=3)
    assert events_of(run, "status")[-1]["state"] == "stopped"
    stopped_at = events_of(run, "checkpoint")[-1]["step"]
    assert 3 <= stopped_at < 12, stopped_at
    assert [e["step"] for e in events_of(run, "eval")] == [0]

    run_engine(tmp_path, None, resume=run, runs_dir=runs_dir)
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert [s["start_step"] for s in events_of(run, "start")] == [0, stopped_at]

    def losses(r: Path) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in events_of(r, "step")}

    def evals(r: Path) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "t"} for e in events_of(r, "eval")]

    assert len(losses(whole_run)) == 12
    assert losses(run) == losses(whole_run)
    assert [e["step"] for e in evals(whole_run)] == [0, 12]
    assert evals(run) == evals(whole_run)


def test_a_task_counting_tokens_gets_a_mean_over_tokens(tmp_path):
    profile = eval_profile(tmp_path, max_steps=2, extra="eval_batch_size = 3", ranks=2)
    run = run_engine(tmp_path, profile, ranks=2, env={"TOKENS": "1"})
    for e in events_of(run, "eval"):
        # sum of i (i + 1) over sum of (i + 1), i = 0..9: 330 / 55 tokens
        assert e["loss"] == pytest.approx(6.0, rel=1e-6)  # over samples: 5.01
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]))


def test_several_splits_each_named_and_one_kept_best(tmp_path):
    profile = eval_profile(tmp_path, max_steps=2, extra="eval_batch_size = 3", ranks=2)
    text = profile.read_text() + '[checkpoint]\nkeep_best = "eval.val/loss"\n'
    profile.write_text(text.replace("eval_at_start = true", ""))
    run = run_engine(tmp_path, profile, ranks=2, env={"SPLITS": "1"})
    [e] = events_of(run, "eval")
    assert e["val/loss"] == pytest.approx(4.5) and e["train_est/loss"] == pytest.approx(14.5)
    assert e["val/perplexity"] == pytest.approx(math.exp(4.5))  # derived per split
    assert "loss" not in e
    [best] = [c for c in events_of(run, "checkpoint") if c.get("best")]
    assert (best["metric"], best["value"]) == ("eval.val/loss", pytest.approx(4.5))
    assert (run / "checkpoints" / "BEST").is_file()


def test_a_long_eval_shows_progress_and_is_never_a_stall(procs, runs_dir, tmp_path):
    # 3 eval batches a rank, 4.5 s each: each longer than the stall limit of 3 s (the first
    # before any was timed), the eval four times it.
    profile = eval_profile(tmp_path, max_steps=2, extra="eval_batch_size = 1", ranks=2)
    profile.write_text(profile.read_text().replace("eval_at_start = true", ""))
    env = cli_env(GPU_CONSOLE_STALL_S="3", EVAL_PACE_S="4.5", EVAL_N="6")
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                       cwd=tmp_path, env=env)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "stalled" not in out.lower(), out
    run = only_run(runs_dir)
    progress = events_of(run, "progress")
    assert len(progress) == 3, progress  # a batch each, at most about once a second
    assert {(p["phase"], p["step"], p["total"]) for p in progress} == {("eval", 2, 3)}
    assert [p["done"] for p in progress] == [0, 1, 2]
    assert "eval 2/3 @ step 2" in out
    # Each rank timed its batches: what judged the second and third.
    beats = read_heartbeats(run)
    assert [b["eval_s"] == pytest.approx(4.5, abs=1.5) for b in beats] == [True, True], beats
    [evaluated] = events_of(run, "eval")
    assert evaluated["step"] == 2


def test_stall_counts_an_eval_batch_as_a_sign_of_life(monkeypatch):
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", "3")
    now = time.time()
    status = {"state": "running", "pids": {"supervisor": os.getpid()}, "last_step_t": now - 60}
    assert derived_state(status, now) == "stalled"
    status["eval_progress"] = {"step": 2, "done": 5, "total": 8, "t": now - 1}
    assert derived_state(status, now) == "running"
    status["eval_progress"]["t"] = now - 10  # the eval's batches stopped advancing too
    assert derived_state(status, now) == "stalled"


def test_the_end_of_an_eval_is_a_sign_of_life_until_the_next_step(monkeypatch):
    # The race CI met: the eval's event clears the progress, the run's end comes a moment
    # later, and in between the step before the eval was all a reader had to go on.
    monkeypatch.setenv("GPU_CONSOLE_STALL_S", "3")
    now = time.time()
    fold = RunFold()
    fold.apply({"kind": "step", "step": 2, "loss": 1.0, "t": now - 8})
    progress = {"phase": "eval", "step": 2, "done": 6, "total": 8, "t": now - 4}
    fold.apply({"kind": "progress", **progress})
    fold.apply({"kind": "eval", "step": 2, "metrics": {"loss": 1.0}, "t": now - 1})
    status = {**fold.to_status(), "state": "running", "pids": {"supervisor": os.getpid()}}
    assert status["eval_progress"] is None
    assert derived_state(status, now) == "running"
    assert derived_state(status, now + 5) == "stalled"  # and nothing since: a stall again
    fold.apply({"kind": "start", "start_step": 2, "t": now})  # a new session: a new count
    assert fold.to_status()["eval_end_t"] is None


def test_eval_at_start_is_the_runs_step_0_or_a_resume_that_turns_it_on():
    on = [{"key": "train.eval_at_start", "old": False, "new": True}]
    assert not at_start(False, 0, None, [])
    assert at_start(True, 0, None, [])  # a fresh run: step 0
    assert not at_start(True, 15, 10, [])  # a plain resume between evals: the run did not
    assert not at_start(True, 15, None, [])
    assert not at_start(True, 0, 0, [])  # resumed at step 0, where the run evaluated already
    assert at_start(True, 15, 10, on)  # asked for on this resume
    assert not at_start(True, 15, 15, on)  # the end of a finished run evaluated at 15


def test_a_stall_inside_an_eval_names_its_batch(tmp_path):
    beat = Heartbeat(tmp_path, rank=0, local_rank=0, restart=0)
    try:
        beat.set(2, "eval", "3/8")
        beat._write()
        beats = read_heartbeats(tmp_path)
    finally:
        beat.close("done")
    assert beats[0]["detail"] == "3/8"
    assert describe_stopped(beats, time.time()).startswith("rank 0 (step 2, eval 3/8, for ")
