"""Train-time metrics: what a task returns in ``TaskOutput.metrics`` at training steps goes
into the step events, reduced over the log window and the ranks as the task declares
(``metric_reduce``), run by the engine on 2 CPU ranks (the harness, tests/harness.py); the
headless summary made from the run's events shows the last value of each."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import events_of, only_run, read_events, task_profile
from harness import run_engine

from gpu_console.engine.train_metrics import MetricReduceError, TrainMetrics, declared
from gpu_console.state import RunState
from gpu_console.summary import summary_lines
from gpu_console.tasks.base import TaskOutput

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

# Values depend on the rank and on the step's parity (every log window holds two steps, one
# odd, one even), so each reduction gives its own, known answer. Tensors (kept on the device)
# and plain numbers (kept on the host) both.
RANKED = """
import torch
from gpu_console.tasks.base import TaskOutput
from gpu_console.tasks.mlp import MLPTask


class Ranked(MLPTask):
    metric_reduce = {
        "rank_max": "max",
        "rank_first": "rank0",
        "count": "sum",
        "per_token": "mean_tokens",
    }

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def flops_per_sample(self):
        return 1.0  # no measuring pass: every compute call below is a training step

    def compute(self, model, batch):
        out = super().compute(model, batch)
        if not model.training:
            return out
        rank, odd = self.ctx.rank, self.calls % 2
        self.calls += 1
        out.tokens = out.samples * (1 + 2 * rank)  # rank 1 weighs 3× per token
        out.metrics = {
            "rank_max": torch.tensor(rank + 0.5 * odd),  # max over ranks and window: 1.5
            "rank_first": 10 * rank + odd,  # rank 0's mean over the window: 0.5
            "count": torch.full((3,), 1.0 + rank + odd),  # rank means 1.5, 2.5; summed: 4
            "rank_mean": rank,  # undeclared: the mean over samples, 0.5
            "per_token": rank,  # over tokens: 3 / 4
        }
        return out
"""

EXPECTED = {"rank_max": 1.5, "rank_first": 0.5, "count": 4.0, "rank_mean": 0.5, "per_token": 0.75}


def summary_of(run: Path) -> str:
    """The headless console's end summary (off a terminal) of the run's events."""
    st = RunState()
    for e in read_events(run):
        st.apply(e)
    return "\n".join(summary_lines(st, run))


def test_metrics_are_reduced_over_the_window_and_ranks_as_declared(tmp_path):
    profile = task_profile(tmp_path, "ranked", RANKED, "Ranked", max_steps=6, ranks=2)
    profile.write_text(profile.read_text().replace("log_every = 1", "log_every = 2"))
    run = run_engine(tmp_path, profile, ranks=2)
    assert events_of(run, "status")[-1]["state"] == "finished"
    steps = events_of(run, "step")
    assert [e["step"] for e in steps] == [2, 4, 6]
    for e in steps:
        assert e["metrics"] == pytest.approx(EXPECTED)
    # The headless summary: the last value of each.
    summary = summary_of(run)
    for name, value in EXPECTED.items():
        assert f"train {name}: {value:g}" in summary


GAN_METRICS = """
import torch
from gan_task import GanStepTask


class GanMetrics(GanStepTask):
    metric_reduce = {"D(x)": "rank0"}

    def train_step(self, model, batch, optimizers, ctx):
        out = super().train_step(model, batch, optimizers, ctx)
        out.metrics = {"Loss_D": torch.tensor(float(ctx.rank + 1)), "D(x)": ctx.rank + 0.25}
        return out
"""


def test_a_task_owned_step_reports_its_metrics(tmp_path):
    (tmp_path / "gan_task.py").write_text((Path(__file__).parent / "gan_task.py").read_text())
    profile = task_profile(tmp_path, "gan_metrics", GAN_METRICS, "GanMetrics", max_steps=4, ranks=2)
    text = profile.read_text().replace("train_samples = 8192\neval_samples = 512\n", "")
    profile.write_text(text.replace("hidden_dim = 64\n", ""))
    run = run_engine(tmp_path, profile, ranks=2)
    assert events_of(run, "status")[-1]["state"] == "finished"
    steps = events_of(run, "step")
    assert len(steps) == 4
    for e in steps:
        assert e["metrics"] == pytest.approx({"Loss_D": 1.5, "D(x)": 0.25})
    summary = summary_of(run)
    assert "train Loss_D: 1.5" in summary
    assert "train D(x): 0.25" in summary


def test_an_unknown_reduction_is_named():
    class Task:
        metric_reduce = {"acc": "median"}

    with pytest.raises(MetricReduceError, match=r"metric_reduce\['acc'\] = 'median'"):
        declared(Task())
    assert declared(type("T", (), {"metric_reduce": lambda self: {"n": "sum"}})()) == {"n": "sum"}


def test_a_run_whose_task_declares_an_unknown_reduction_fails_naming_it(tmp_path):
    source = "from gpu_console.tasks.mlp import MLPTask\n\n\nclass Bad(MLPTask):\n"
    source += '    metric_reduce = {"accuracy": "median"}\n'
    profile = task_profile(tmp_path, "bad_reduce", source, "Bad", max_steps=2)
    said = "task.metric_reduce['accuracy'] = 'median': expected one of"
    with pytest.raises(MetricReduceError, match=re.escape(said)):
        run_engine(tmp_path, profile)
    # The run's end, as the console shows it: failed, naming the key.
    ended = events_of(only_run(tmp_path / "runs"), "status")[-1]
    assert ended["state"] == "failed" and said in ended["reason"]
    assert not events_of(only_run(tmp_path / "runs"), "step")


def _out(samples: int, **metrics) -> TaskOutput:
    return TaskOutput(loss=torch.tensor(0.0), samples=samples, metrics=metrics)


def test_cpu_metrics_are_kept_as_host_numbers():
    """On CPU a tensor metric is read to the host (no tensor operation a step): the columns
    are plain numbers, weighted by samples as declared, and a NaN wins a ``max``."""

    task = type("T", (), {"metric_reduce": {"worst": "max"}})()
    warned: list[str] = []
    m = TrainMetrics(task, 0, 1, torch.device("cpu"), warned.append)
    m.add(_out(2, acc=torch.tensor(0.5), worst=torch.tensor(1.0)))
    m.add(_out(6, acc=torch.tensor([1.0, 0.0, 1.0, 1.0]), worst=torch.tensor(float("nan"))))
    m.add(_out(6, worst=torch.tensor(2.0)))
    cols = m.columns()
    assert all(isinstance(c, (int, float)) for c in cols)
    assert m.names == ["acc", "worst"]
    assert cols[0] == 0.5 * 2 + 0.75 * 6 and cols[1] == 8
    assert math.isnan(cols[2]) and cols[3] == 3
    reduced = m.reduced([cols])
    assert reduced["acc"] == pytest.approx(5.5 / 8) and math.isnan(reduced["worst"])
    m.reset()
    m.add(_out(1, acc=1.0, late=1.0))
    m.add(_out(1, late=2.0))
    assert m.columns() == [1.0, 1, 0.0, 0]  # "worst" absent this window; "late" left out
    assert len(warned) == 1 and "'late'" in warned[0]
