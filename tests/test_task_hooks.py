"""The task's context, hooks and state on 2 CPU ranks: through the real CLI and torchrun where
the console's output, its logs or a stop matter, else the engine in the harness
(tests/harness.py).

The task (tests/hooks_task.py) writes what it saw into ``ctx.task_dir``; these tests read it.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    deadline,
    events_of,
    fast_profile,
    only_run,
    read_events,
    read_status,
    run_dirs,
    wait_for,
)
from conftest import test_env as cli_env
from harness import run_engine

from gpu_console.engine.context import TaskContext
from gpu_console.engine.hooks import Hooks
from gpu_console.profile import Profile
from gpu_console.tui.feed import RunFeed

KIND = "tests.hooks_task:HooksTask"


def hooks_profile(tmp_path: Path, max_steps: int, name: str = "hooks", kind: str = KIND) -> Path:
    """640 samples over 2 ranks of 32: an epoch is 10 steps; an eval every 10 steps."""
    profile = fast_profile(tmp_path, name=name, max_steps=max_steps, ranks=2)
    text = profile.read_text().replace('kind = "mlp"', f'kind = "{kind}"')
    text = text.replace("train_samples = 8192", "train_samples = 640")
    profile.write_text(text.replace("log_every = 1", "log_every = 1\neval_every = 10"))
    return profile


def seen(run: Path, what: str, rank: int, start: int = 0) -> dict:
    return json.loads((run / "task" / f"{what}-{rank}-{start}.json").read_text())


def task_logs(run: Path) -> list[dict]:
    return [e for e in events_of(run, "log") if e.get("source") == "task"]


def test_context_and_every_hook_on_every_rank_in_a_finished_run(procs, runs_dir, tmp_path):
    profile = hooks_profile(tmp_path, max_steps=25)
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run(runs_dir)
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [10, 20, 25]
    for rank in (0, 1):
        assert seen(run, "ctx", rank) == {
            "rank": rank,
            "world_size": 2,
            "local_rank": rank,
            "device": "cpu",
            "run_dir": str(run),
            "task_dir": str(run / "task"),
            "task_dir_exists": True,
            "batch_size": 32,
            "grad_accum": 1,
            "max_steps": 25,
            "hidden_dim": 64,
            "resumed": False,
            "start_step": 0,
            "step": 0,
        }
        hooks = seen(run, "hooks", rank)
        assert [s[0] for s in hooks["steps"]] == list(range(1, 26))
        assert [s[1] for s in hooks["steps"]] == [0] * 10 + [1] * 10 + [2] * 5
        # ctx.batch_in_epoch: the batches drawn from ctx.epoch (10 an epoch, one a step).
        assert [s[3] for s in hooks["steps"]] == [*range(1, 11), *range(1, 11), *range(1, 6)]
        assert hooks["optimizers"] == {"main": "AdamW"}  # ctx.optimizers, by name
        # on_eval_start: before each eval (none of it ended yet), at the eval's step.
        assert hooks["eval_starts"] == [[e["step"], i] for i, e in enumerate(evals)]
        assert hooks["epochs"] == [[0, 10], [1, 20]]  # epoch, the step that ended it
        # Every rank gets the reduced metrics: the eval events' numbers.
        assert hooks["evals"] == [[e["step"], {"loss": e["loss"], "accuracy": e["accuracy"]}]
                                  for e in evals]  # fmt: skip
        assert hooks["end"] == [["finished", 25]]
        assert (run / "task" / f"sample-{rank}.txt").read_text() == "finished at 25\n"
    # The end hook runs after the end checkpoint, before the final status.
    kinds = [e["kind"] for e in read_events(run)]
    assert kinds[-1] == "status" and kinds[-2] == "checkpoint"

    # ctx.log: rank 0's lines are log events (in the headless output too); rank 1's go to its
    # own log, prefixed.
    lines = [f"eval hook at step {e['step']}: loss {e['loss']:.6f}" for e in evals]
    logged = task_logs(run)
    assert [(e["level"], e["message"]) for e in logged] == [("info", m) for m in lines]
    for line in lines:
        assert f"info: {line}" in result.stdout, result.stdout
    rank_1 = "".join(p.read_text() for p in (run / "logs").rglob("*") if p.is_file())
    assert f"rank 1: {lines[0]}" in rank_1
    assert "rank 1: eval hook" not in result.stdout
    # The console's log pane: what the run screen's feed hands over.
    feed = RunFeed(run, telemetry=False)
    feed.load()
    pane = [(line.level, line.text) for line in feed.snapshot().new_logs]
    for line in lines:
        assert ("info", f"[info] {line}") in pane, pane
    # Rank 1's own output reaches the pane as that rank's lines (torchrun's tee).
    assert ("info", f"r1│ [info] rank 1: {lines[0]}") in pane, pane


@pytest.mark.parametrize("how, reason", [("control", "stopped"), ("sigterm", "signal")])
def test_a_stop_ends_the_run_through_on_train_end_on_every_rank(
    procs, runs_dir, tmp_path, how, reason
):
    profile = hooks_profile(tmp_path, max_steps=100_000)
    if how == "control":  # the engine's half: the harness, the command appended meanwhile
        run = run_engine(tmp_path, profile, ranks=2, runs_dir=runs_dir, cwd=REPO,
                         env={"PACE_S": "0.01"}, stop_after=12)  # fmt: skip
        assert events_of(run, "status")[-1]["state"] == "stopped"
    else:  # a scheduler's SIGTERM to the headless console: the process tree's
        console = procs.start(
            "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=REPO,
            env=cli_env(PACE_S="0.01"),
        )  # fmt: skip
        run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run dir")
        wait_for(lambda: any(e["step"] >= 12 for e in events_of(run, "step")), what="step 12")
        console.send_signal(signal.SIGTERM)
        out, err = console.communicate(timeout=deadline(120))
        assert console.returncode == 0, out + err
        assert read_status(run)["state"] == "stopped"
    stopped_at = events_of(run, "checkpoint")[-1]["step"]
    for rank in (0, 1):
        hooks = seen(run, "hooks", rank)
        assert hooks["end"] == [[reason, stopped_at]]
        assert [s[0] for s in hooks["steps"]] == list(range(1, stopped_at + 1))
        assert [e[1] for e in hooks["epochs"]] == list(range(10, stopped_at + 1, 10))
        assert [e[0] for e in hooks["evals"]] == list(range(10, stopped_at + 1, 10))


def test_task_state_resumes_exactly_per_rank(tmp_path):
    """Ended mid-epoch and resumed, a task whose loss depends on its carried state trains as
    an uninterrupted run does, bit for bit (every step's loss, every eval). The engine on 2
    ranks (the harness, tests/harness.py); how a stop ends the run is the test above's."""
    (tmp_path / "hooks_task.py").write_text((Path(__file__).parent / "hooks_task.py").read_text())
    profile = hooks_profile(tmp_path, max_steps=60, kind="hooks_task:HooksTask")
    # The schedule's horizon is the whole run's, however many steps a session makes.
    horizon = "train.lr_decay_steps=60"
    whole = run_engine(tmp_path, profile, horizon, ranks=2, runs_dir=tmp_path / "whole")

    stopped_at = 13  # in epoch 1 (10 steps an epoch), between two evals
    part = tmp_path / "part"
    first = (horizon, f"train.max_steps={stopped_at}")
    run = run_engine(tmp_path, profile, *first, ranks=2, runs_dir=part)
    run_engine(tmp_path, None, "train.max_steps=60", ranks=2, resume=run, runs_dir=part)
    assert events_of(run, "status")[-1]["state"] == "finished"

    def losses(r: Path) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in events_of(r, "step")}

    def evals(r: Path) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "t"} for e in events_of(r, "eval")]

    assert losses(run) == losses(whole)
    # The first session's end had its own eval (a run's last step is evaluated): the rest
    # are the uninterrupted run's.
    assert [e["step"] for e in evals(run)] == [10, stopped_at, 20, 30, 40, 50, 60]
    assert [e for e in evals(run) if e["step"] != stopped_at] == evals(whole)
    for rank in (0, 1):
        ctx = seen(run, "ctx", rank, stopped_at)
        assert (ctx["resumed"], ctx["start_step"], ctx["step"]) == (True, stopped_at, stopped_at)
        before, after = seen(run, "hooks", rank), seen(run, "hooks", rank, stopped_at)
        assert after["restored"]["micro_steps"] == stopped_at  # this rank's own state
        assert after["steps"] == seen(whole, "hooks", rank)["steps"][stopped_at:]
        assert before["steps"] + after["steps"] == seen(whole, "hooks", rank)["steps"]
    # Each rank's state differs (their data do), so each got its own back.
    carries = [seen(run, "hooks", r, stopped_at)["restored"]["carry"] for r in (0, 1)]
    assert carries[0] != carries[1]


class Stateful:
    def __init__(self):
        self.loaded = []

    def load_state_dict(self, state):
        self.loaded.append(state)


def context(rank: int, world_size: int, tmp_path: Path, resumed: bool = True) -> TaskContext:
    return TaskContext(rank, world_size, rank, torch.device("cpu"), tmp_path, Profile(), resumed)


def test_on_another_world_size_rank_r_gets_rank_rs_state_or_none_and_a_warning(tmp_path):
    saved = [{"carry": torch.tensor(float(r))} for r in range(2)]
    for rank, expected in ((0, [saved[0]]), (1, [saved[1]]), (2, [])):
        task, warnings = Stateful(), []
        Hooks(task, context(rank, 3, tmp_path)).restore(saved, 3, warnings.append)
        assert task.loaded == expected
        assert warnings == [
            "task state saved by 2 ranks, resumed on 3: rank r gets rank r's state, "
            "ranks 2 and up start without"
        ]
    task, warnings = Stateful(), []
    Hooks(task, context(1, 2, tmp_path)).restore(saved, 2, warnings.append)
    assert task.loaded == saved[1:] and warnings == []
    # A copy: the checkpoint's tensors are its file's mapping.
    assert task.loaded[0]["carry"].data_ptr() != saved[1]["carry"].data_ptr()


def test_ctx_log_names_a_bad_level(tmp_path):
    with pytest.raises(ValueError, match=r"ctx.log: level must be one of info, warning, error"):
        context(0, 1, tmp_path).log("hello", level="debug")


def test_a_dry_run_gives_the_task_a_context_and_leaves_nothing(procs, runs_dir, tmp_path):
    profile = hooks_profile(tmp_path, max_steps=25)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = procs.cli(
        "run", str(profile), "--dry-run", "--json", "--runs-dir", str(runs_dir), cwd=REPO,
        env=cli_env(TMPDIR=str(scratch)),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["task"] == KIND
    assert not runs_dir.exists()
    # The plan's run directory (the task wrote into it) is gone with the planning process.
    assert list(scratch.glob("gpu-console-plan-*")) == []
