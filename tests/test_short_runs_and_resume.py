"""A new user's short run and resume, through the real CLI (2 CPU ranks under torchrun; what
the engine writes, on the engine harness: tests/harness.py).

``--set train.max_steps=N`` shortens a built-in profile: its warmup gives way, said in one
line. A resume that cannot go on (a finished run, another task or model) is refused in one
line, exit 2, before anything is written; a resume that goes on says first where it continues
from. Every run ends with a checkpoint labelled ``end``, also where an interval falls on its
last step, and a step is checkpointed once.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import Procs, events_of, only_run, read_status, set_args
from harness import run_engine

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_STEPS = 10
NOTE = (
    f"--set train.max_steps={MAX_STEPS}: train.warmup_steps 20 → {MAX_STEPS} (the profile's "
    "warmup is longer than this run; the lr rises to its peak over the whole run)"
)
# quickstart shortened, an interval every 5 steps (so one falls on the last step).
SHORT = (f"train.max_steps={MAX_STEPS}", "checkpoint.every_steps=5")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """quickstart shortened to 10 steps, an interval every 5 (so one falls on the last step):
    (the CLI's result, the run directory). Tests that only read it share it."""
    runs = tmp_path_factory.mktemp("short") / "runs"
    procs = Procs(runs)
    try:
        result = procs.cli("run", "quickstart", "--headless", "--devices", "cpu:2",
                           "--runs-dir", str(runs), *set_args(*SHORT))  # fmt: skip
        yield result, only_run(runs)
    finally:
        procs.cleanup()


def _files(run: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry of a run directory with its mtime (and a file's bytes)."""
    return {
        str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(run.rglob("*"))
    }


def test_a_short_quickstart_run_clamps_the_warmup_and_says_so(short_run):
    result, run = short_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.splitlines().count(NOTE) == 1, result.stderr
    assert "Traceback" not in result.stderr
    toml = tomllib.loads((run / "run.toml").read_text())
    assert toml["train"]["warmup_steps"] == MAX_STEPS and toml["train"]["max_steps"] == MAX_STEPS
    status = read_status(run)
    assert status["state"] == "finished" and status["step"] == MAX_STEPS


def test_the_last_checkpoint_is_the_end_one_written_once(tmp_path):
    # every_steps = 5 falls on the last step: that step is the end checkpoint's, written once.
    run = run_engine(tmp_path, "quickstart", *SHORT, ranks=2)
    written = [(c["step"], c["reason"]) for c in events_of(run, "checkpoint")]
    assert written == [(5, "interval"), (MAX_STEPS, "end")]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step-{MAX_STEPS:08d}"


def test_resuming_a_finished_run_is_refused_in_one_line_with_nothing_written(
    short_run, procs, tmp_path
):
    _, run = short_run
    before = _files(run)
    again = procs.cli("run", "--resume", str(run), "--headless", cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    assert again.stderr.splitlines() == [
        f"gpu-console: --resume: {run}: already at max_steps {MAX_STEPS}; raise "
        "train.max_steps to continue (--set train.max_steps=N)"
    ]
    assert again.stdout == ""
    assert _files(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == [run.name]


@pytest.mark.parametrize(
    "args, line",
    [
        # Another profile, whose task is another.
        (
            ["transformer"],
            "{transformer}: task.kind: {name} trained task 'mlp': a resumed run keeps its task "
            "and model; start a new run, or resume without PROFILE (got 'transformer')",
        ),
        # The run's own profile, another task kind on the command line.
        (
            ["--set", "task.kind=transformer", "--set", "train.max_steps=20"],
            "--set: task.kind: {name} trained task 'mlp': a resumed run keeps its task and "
            "model; start a new run, or resume without PROFILE (got 'transformer')",
        ),
        # The same task, another model size.
        (
            ["quickstart", "--set", "task.num_layers=2", "--set", "train.max_steps=20"],
            "--set: task.num_layers: a resumed run cannot change it (was 3): the checkpoint's "
            "model does not load into the one it builds (2.weight: [256, 256] in the "
            "checkpoint, [10, 256] now; 2.bias: [256] in the checkpoint, [10] now; and 2 more) "
            "(got 2)",
        ),
    ],
)
def test_a_resume_with_another_task_or_model_is_refused_before_launch(
    short_run, procs, tmp_path, args, line
):
    from gpu_console.profile import find_profile

    _, run = short_run
    before = _files(run)
    refused = procs.cli("run", *args, "--resume", str(run), "--headless", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    expected = line.format(transformer=find_profile("transformer"), name=run.name)
    assert refused.stderr.splitlines() == [f"gpu-console: {expected}"]
    assert _files(run) == before


def test_a_resumed_run_says_first_where_it_continues_from(short_run, procs, runs_dir, tmp_path):
    _, finished = short_run
    run = runs_dir / finished.name
    shutil.copytree(finished, run)  # a finished run of its own, to continue
    more = procs.cli("run", "--resume", str(run), "--headless", "--set", "train.max_steps=12",
                     cwd=tmp_path)  # fmt: skip
    assert more.returncode == 0, more.stdout + more.stderr
    lines = more.stdout.splitlines()
    assert lines[0] == f"resumed from {run.name} at step {MAX_STEPS}", more.stdout
    assert lines[1].startswith(f"run {run.name}")
    assert read_status(run)["step"] == 12


def test_the_transformer_profile_ends_with_an_end_checkpoint(tmp_path):
    # Its every_steps divides its max_steps (as 2 divides 4 here): the last one says end.
    small = ["task.d_model=16", "task.n_heads=2", "task.n_layers=1", "task.seq_len=8",
             "task.train_samples=256", "task.eval_samples=32", "data.batch_size=8",
             "train.max_steps=4", "checkpoint.every_steps=2"]  # fmt: skip
    run = run_engine(tmp_path, "transformer", *small, ranks=2)
    written = [(c["step"], c["reason"]) for c in events_of(run, "checkpoint")]
    assert written == [(2, "interval"), (4, "end")]
