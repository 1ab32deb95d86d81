"""The engine harness itself (tests/harness.py): a rank's exception reaches the test as
itself, the other rank is ended with it and nothing is left running; one rank in this process
leaves the process as it found it (its group, its flags, its threads, its modules)."""

from __future__ import annotations

import json
import signal
import sys

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import events_of, only_run, paced_profile, task_profile
from harness import RemoteTraceback, run_engine, zygote_pid

from gpu_console.engine.failure_checkpoint import AfterUpdateFailed

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

FAILING = """
import os

from gpu_console.tasks.mlp import MLPTask


class RankOneFails(MLPTask):
    def compute(self, model, batch):
        if os.environ["RANK"] == "1" and model.training:
            raise LookupError("rank 1 cannot go on")
        return super().compute(model, batch)
"""


def test_a_ranks_exception_reaches_the_test_as_itself_and_its_peer_is_ended(tmp_path):
    profile = task_profile(tmp_path, "failing", FAILING, "RankOneFails", max_steps=4)
    with pytest.raises(LookupError, match="rank 1 cannot go on") as info:
        run_engine(tmp_path, profile, ranks=2)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 1's traceback" in str(cause) and "in compute" in str(cause)
    # Rank 0, left waiting for rank 1 in a collective, was ended by pid and reaped.
    assert psutil.Process(zygote_pid()).children() == []


def test_one_rank_in_this_process_leaves_it_as_it_found_it(tmp_path):
    profile = task_profile(tmp_path, "mine", "from gpu_console.tasks.mlp import MLPTask\n\n\n"
                           "class Mine(MLPTask):\n    pass\n", "Mine", max_steps=2)  # fmt: skip
    threads, path = torch.get_num_threads(), list(sys.path)
    handler = signal.getsignal(signal.SIGTERM)
    assert not torch.are_deterministic_algorithms_enabled()
    run = run_engine(tmp_path, profile, "train.deterministic=true")
    start = events_of(run, "start")[0]
    assert start["deterministic"]["algorithms"] is True  # in effect while it ran
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert not torch.are_deterministic_algorithms_enabled()
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads and sys.path == path
    assert signal.getsignal(signal.SIGTERM) == handler
    assert "mine" not in sys.modules  # the next test's module of that name is another file


STEPPING = """
from gpu_console.tasks.mlp import MLPTask


class Stepping(MLPTask):
    def train_step(self, model, batch, optimizers, ctx):
        out = self.compute(model, batch)
        optimizers.backward(out.loss, "main")
        optimizers.step("main")
        return out
"""


def test_a_loader_forked_after_an_in_process_run_does_not_hang(tmp_path):
    # A run's objects that held its process group in a reference cycle, collected in a
    # DataLoader worker forked later, waited there forever for gloo's threads (the fork
    # copies none): the harness collects them before it returns.
    from gpu_console.engine.data import make_loader
    from gpu_console.profile import DataConfig
    from gpu_console.tasks.base import TensorSet

    profile = task_profile(tmp_path, "stepping", STEPPING, "Stepping", max_steps=2)
    run = run_engine(tmp_path, profile)
    assert events_of(run, "start")[0]["train_step"] == "task"
    cfg = DataConfig(batch_size=4, num_workers=2, persistent_workers=False)
    loader = make_loader(TensorSet(torch.arange(16)), cfg, 0, 1, True, False)
    assert sorted(x for (b,) in loader for x in b.tolist()) == list(range(16))


FAILS_UNLESS_FIXED = """
import os

from gpu_console.tasks.mlp import MLPTask


class FailsUntilFixed(MLPTask):
    def on_step_end(self, model, output, ctx):
        if ctx.step == 3 and os.environ.get("BROKEN"):
            raise LookupError("the first session breaks")
"""


def test_a_resume_in_place_is_judged_by_its_own_ranks_not_the_failed_session_before(tmp_path):
    every_2 = "[checkpoint]\nevery_steps = 2\n"
    profile = task_profile(tmp_path, "fixed", FAILS_UNLESS_FIXED, "FailsUntilFixed",
                           max_steps=6, ranks=2, extra=every_2)  # fmt: skip
    # A hook that fails after the update: its step is checkpointed (failure_checkpoint.py).
    with pytest.raises(AfterUpdateFailed, match="the first session breaks"):
        run_engine(tmp_path, profile, ranks=2, env={"BROKEN": "1"})
    run = only_run(tmp_path / "runs")
    run_engine(tmp_path, None, ranks=2, resume=run)  # both ranks end well: nothing raised
    assert events_of(run, "status")[-1]["state"] == "finished"
    assert [s["start_step"] for s in events_of(run, "start")] == [0, 3]


def test_a_stop_after_a_step_is_the_consoles_stop_command(tmp_path):
    profile = paced_profile(tmp_path, max_steps=100_000)
    run = run_engine(tmp_path, profile, env={"PACE_S": "0.02"}, stop_after=3)
    stopped = events_of(run, "status")[-1]
    assert stopped["state"] == "stopped" and stopped["step"] >= 3
    (command,) = [json.loads(line) for line in (run / "control.jsonl").read_text().splitlines()]
    assert command["cmd"] == "stop"
    acks = [e["state"] for e in events_of(run, "control") if e["id"] == command["id"]]
    assert acks == ["received", "done"]
