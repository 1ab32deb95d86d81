"""``on_eval_end`` may return figures of its own, a score over several eval splits, which
join the eval event and which ``checkpoint.keep_best`` can name (issue 26). The run is on the
engine harness (tests/harness.py); its headless eval line is read with headless_text."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import events_of, task_profile
from harness import run_engine
from headless_text import headless_text

from gpu_console.engine.hooks import added_figures
from gpu_console.runs import best_checkpoint

TWO_SPLITS = """
from gpu_console.tasks.base import TensorSet
from gpu_console.tasks.mlp import MLPTask


class TwoSplits(MLPTask):
    def build_datasets(self):
        train, ev = super().build_datasets()
        x, y = ev.tensors
        return train, {"a": ev, "b": TensorSet(x[:128], y[:128])}

    def on_eval_end(self, model, metrics, ctx):
        return {"score": metrics["a/loss"] + 0.5 * metrics["b/loss"]}
"""


def test_a_score_over_two_splits_is_in_each_eval_and_keeps_the_best(tmp_path):
    extra = '[checkpoint]\nkeep_best = "eval.score"\nbest_mode = "min"\nevery_steps = 0\n'
    profile = task_profile(tmp_path, "twosplits", TWO_SPLITS, "TwoSplits", max_steps=8,
                           extra=extra)  # fmt: skip
    text = profile.read_text().replace("log_every = 1", "log_every = 1\neval_every = 2")
    profile.write_text(text.replace("lr = 3e-3", "lr = 3e-2"))
    run = run_engine(tmp_path, profile)
    assert events_of(run, "status")[-1]["state"] == "finished"
    out = headless_text(run)
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    for e in evals:
        assert e["score"] == pytest.approx(e["a/loss"] + 0.5 * e["b/loss"], rel=1e-12), e
    best = min(evals, key=lambda e: e["score"])
    named = best_checkpoint(run)
    assert named is not None and named.name == f"step-{best['step']:08d}", (named, evals)
    # The headless eval line shows it with the eval's own figures.
    [line] = [ln for ln in out.splitlines() if ln.startswith("eval @ step 8:")]
    assert " a/loss " in line and "  score " in line, line


def test_what_on_eval_end_returns_is_checked():
    metrics = {"loss": 1.0, "a/loss": 2.0}
    assert added_figures(None, metrics) == {}
    assert added_figures({"score": torch.tensor(0.25), "n": 3}, metrics) == {
        "score": 0.25,
        "n": 3.0,
    }
    assert math.isnan(added_figures({"s": float("nan")}, metrics)["s"])  # keep_best skips it
    with pytest.raises(TypeError, match="must return None or a dict"):
        added_figures([1.0], metrics)
    with pytest.raises(ValueError, match="'a/loss', a metric the eval reported already"):
        added_figures({"a/loss": 0.0}, metrics)
    with pytest.raises(TypeError, match="'s' = 'high': not a number"):
        added_figures({"s": "high"}, metrics)
    with pytest.raises(TypeError, match="not a number"):
        added_figures({"s": torch.ones(3)}, metrics)
